"""Imports the compiled kernels: one extension module, ``attnlab._core``.

The kernel sources are compiled once per instruction set into that module (``generic``: the
x86-64 baseline, or NEON on aarch64; ``avx2``: x86-64-v3, AVX2 + FMA; ``avx512``: x86-64-v4,
512-bit vectors), each in its own C++ namespace; the bindings are compiled once and call the
kernel table that ``cpp/src/runtime/dispatch.cpp`` picks when the module is imported: the best
variant built that the CPU and operating system support (cpuid and XGETBV).
``ATTNLAB_ISA=generic|avx2|avx512|native`` forces one; an unknown, unbuilt or unsupported value
is an ImportError naming ATTNLAB_ISA, before any kernel code runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__: list[str] = []

PREFERENCE = ("native", "avx512", "avx2", "generic")


def available() -> list[str]:
    """The variants built into the module that this CPU supports, best first."""
    built = set(core.BUILT_ISAS)
    return [isa for isa in PREFERENCE if isa in built and core.isa_supported(isa)]


if TYPE_CHECKING:  # the interface, declared in _core.pyi
    from . import _core as core
else:
    try:
        from . import _core as core
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}._core":
            raise
        raise ImportError(
            "attnlab: the compiled module attnlab._core is missing; reinstall with `pip install .` "
            "(or build it into python/attnlab with scripts/dev-build.sh)"
        ) from e
