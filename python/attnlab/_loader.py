"""Imports the compiled kernels built for the best instruction set this CPU supports.

Three builds of the same C++ sources ship side by side: ``_core_generic`` (x86-64 baseline),
``_core_avx2`` (x86-64-v3: AVX2, FMA, BMI2) and ``_core_avx512`` (x86-64-v4). Eigen cannot mix
instruction sets inside one module, so the choice is made here, once, at import.
``ATTNLAB_ISA=generic|avx2|avx512|native`` forces one.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import TYPE_CHECKING

__all__: list[str] = []

PREFERENCE = ("native", "avx512", "avx2", "generic")

# What each build needs from the CPU (x86-64-v3 / v4 feature sets, as reported by the CPU).
_REQUIRES = {
    "generic": (),
    "avx2": ("avx", "avx2", "fma", "bmi2"),
    "avx512": ("avx", "avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl",
               "avx512cd"),
    "native": (),
}


def _try_import(isa: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"attnlab._core_{isa}")
    except ModuleNotFoundError:
        return None


def _proc_cpuinfo_features() -> dict[str, bool] | None:
    """CPU flags from /proc/cpuinfo, for builds without the generic module to ask."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    names = {f for req in _REQUIRES.values() for f in req}
                    return {n: n in flags for n in names}
    except OSError:
        pass
    return None


def supported(isa: str, features: dict[str, bool] | None) -> bool:
    if isa in ("generic", "native"):
        return True
    if not features:
        return False
    return all(features.get(f, False) for f in _REQUIRES[isa])


def load() -> ModuleType:
    forced = os.environ.get("ATTNLAB_ISA", "").strip().lower()
    generic = _try_import("generic")
    features = dict(generic.cpu_features()) if generic is not None else _proc_cpuinfo_features()
    if forced:
        if forced not in _REQUIRES:
            raise ImportError(
                f"ATTNLAB_ISA={forced!r}: expected one of generic, avx2, avx512, native"
            )
        if features is not None and not supported(forced, features):
            raise ImportError(f"ATTNLAB_ISA={forced!r}: this CPU does not support it")
        mod = generic if forced == "generic" else _try_import(forced)
        if mod is None:
            raise ImportError(f"ATTNLAB_ISA={forced!r}: that variant was not built")
        return mod
    for isa in PREFERENCE:
        if isa == "generic":
            if generic is not None:
                return generic
            continue
        if not supported(isa, features):
            continue
        mod = _try_import(isa)
        if mod is not None:
            return mod
    raise ImportError("attnlab: no compiled kernel module found; reinstall with `pip install .`")


def _built(isa: str) -> bool:
    """Whether the variant exists, without importing it (importing code built for an
    instruction set the CPU lacks can die with SIGILL in its static initialisers)."""
    try:
        return importlib.util.find_spec(f"attnlab._core_{isa}") is not None
    except (ImportError, ValueError):
        return False


def available() -> list[str]:
    """The variants built and supported by this CPU, best first."""
    generic = _try_import("generic")
    features = dict(generic.cpu_features()) if generic is not None else _proc_cpuinfo_features()
    return [isa for isa in PREFERENCE if supported(isa, features) and _built(isa)]


if TYPE_CHECKING:  # the interface of every variant, declared in _core.pyi
    from . import _core as core
else:
    core = load()
