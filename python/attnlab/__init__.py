"""attnlab: exact, fast CPU attention kernels for NumPy.

Multi-head attention (per-head projections), bilinear-collapsed attention and efficient
additive attention, in C++ (Eigen) with plain NumPy references beside them.
"""

from __future__ import annotations

from typing import Any

from . import diagnostics, init, layers, optim, reference
from ._additive import additive_attention, additive_attention_backward
from ._bilinear import (
    BilinearQK,
    bilinear_attention,
    bilinear_attention_backward,
    collapse_qk,
    factorize_qk,
)
from ._latent import latent_attention, latent_attention_backward
from ._loader import core as _core
from ._merge import merge_attention
from ._mha import (
    multi_head_attention,
    multi_head_attention_backward,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from ._packed import PackedWeight
from ._separable import separable_attention, separable_attention_backward
from ._vjp import vjp
from .cost import attention_cost, plan_qk

__version__: str = _core.__version__
#: Upper bound of :func:`set_num_threads` and of ``ATTNLAB_NUM_THREADS``.
MAX_THREADS: int = int(_core.MAX_THREADS)

__all__ = [
    "BilinearQK",
    "MAX_THREADS",
    "PackedWeight",
    "__version__",
    "additive_attention",
    "additive_attention_backward",
    "attention_cost",
    "bilinear_attention",
    "bilinear_attention_backward",
    "collapse_qk",
    "factorize_qk",
    "plan_qk",
    "separable_attention",
    "separable_attention_backward",
    "build_info",
    "get_num_threads",
    "diagnostics",
    "init",
    "latent_attention",
    "latent_attention_backward",
    "layers",
    "optim",
    "multi_head_attention",
    "multi_head_attention_backward",
    "reference",
    "merge_attention",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "set_num_threads",
    "vjp",
]


def get_num_threads() -> int:
    """Threads the kernels use.

    Returns
    -------
    int
        The number last given to :func:`set_num_threads`, else the environment variable
        ``ATTNLAB_NUM_THREADS``, else the CPUs this process may run on (its affinity mask),
        further limited by a cgroup CPU quota (containers) when one is set.
        ``build_info()["num_threads_source"]`` says which.

    Examples
    --------
    >>> import attnlab
    >>> attnlab.get_num_threads() >= 1
    True
    """
    return int(_core.get_num_threads())


def set_num_threads(n: int) -> None:
    """Set the number of threads the kernels use; results are bitwise the same for any number.

    Parameters
    ----------
    n : int
        ``1 <= n <= 1024`` (``attnlab.MAX_THREADS``, also the cap of ``ATTNLAB_NUM_THREADS``).
        Should the operating system refuse to start some threads (a process or memory limit),
        the kernels run on those that started and :func:`get_num_threads` reports them.

    Returns
    -------
    None

    Examples
    --------
    >>> import attnlab
    >>> old = attnlab.get_num_threads()
    >>> attnlab.set_num_threads(1)
    >>> attnlab.set_num_threads(old)
    """
    from ._validate import check_positive_int

    v = check_positive_int(n, "n")
    if v > MAX_THREADS:
        raise ValueError(f"n: expected an integer between 1 and {MAX_THREADS}, got {v}")
    _core.set_num_threads(v)


# Intel's family 6 server models, as Linux's arch/x86/include/asm/intel-family.h names them
_INTEL_XEON_CORES = {
    0x55: "Skylake-SP/Cascade Lake",
    0x6A: "Ice Lake-SP",
    0x6C: "Ice Lake-D",
    0x8F: "Sapphire Rapids",
    0xCF: "Emerald Rapids",
    0xAD: "Granite Rapids",
    0xAE: "Granite Rapids-D",
    0xAF: "Sierra Forest",
}


def _cpu_kind(vendor: str, family: int, model: int, avx512: bool) -> str:
    """The CPU as the project's measurements name it: the microarchitecture where the family
    (AMD) or the family and model (Intel's Xeon cores) tell it, with vendor, family and model
    (cpuid's displayed values)."""
    ids = f"family 0x{family:02x}, model 0x{model:02x}"
    if vendor == "AuthenticAMD":
        name = {0x17: "Zen 2", 0x19: "Zen 4" if avx512 else "Zen 3", 0x1A: "Zen 5"}.get(family)
        return f"AMD {name} ({ids})" if name else f"AMD ({ids})"
    if vendor == "GenuineIntel":
        name = _INTEL_XEON_CORES.get(model) if family == 6 else None
        return f"Intel {name} ({ids})" if name else f"Intel ({ids})"
    return f"{vendor} ({ids})" if vendor else "unknown (not x86-64)"


def build_info() -> dict[str, Any]:
    """Version, instruction set in use, compiler, Eigen version and threads.

    Returns
    -------
    dict
        ``version``; ``module``, the file of the one compiled module (``attnlab._core``);
        ``isa``, the kernel variant in use inside it (``generic``, ``avx2``, ``avx512`` or
        ``native``), with its ``compiled_for`` and ``eigen_simd``; ``built_isas``, every variant
        compiled into the module, best first; ``available_isas``, those this CPU and OS can run;
        ``compiler``, ``eigen_version``; ``num_threads`` and ``num_threads_source``
        (``"set_num_threads"``, ``"ATTNLAB_NUM_THREADS"``, ``"sched_getaffinity"``,
        ``"cgroup cpu quota"`` or ``"hardware_concurrency"``, with a note when it was reduced);
        ``cpu_features``, the instruction sets (and OS register state) the CPU reports;
        ``bf16_kernel``, what ``precision="bf16"`` runs on: ``"amx"`` (TDPBF16PS tiles),
        ``"avx512_bf16"`` (VDPBF16PS, without usable AMX: by default on AMD CPUs only;
        ``ATTNLAB_AVX512_BF16=1`` or ``0`` forces it on or off) or ``"emulated"`` (the same
        roundings on the float32 kernels); ``ATTNLAB_AMX=0`` turns AMX off;
        ``gemm_blocking``, the blocking of the float32/float64 GEMM (projections and their
        gradients) of the variant in use: ``"avx512: ..."`` in the AVX-512 variant
        (``"avx512-intel: ..."`` on Intel, whose kernels also request packed weight rows
        ahead), ``"avx2-large-l2: ..."`` in the AVX2 variant on a CPU whose L2 holds 1 MiB or
        more per core (``l2_cache_bytes``, from cpuid; 0 when unknown), ``"avx2: ..."`` with a
        smaller one, ``"default: ..."`` in the generic variant;
        ``ATTNLAB_GEMM_BLOCKING=default`` forces the default (results are bitwise the
        same either way); ``decode_prefetch``, where the decode path requests the keys and
        values it streams: ``"l2: ..."`` (the GEMM requests the weight rows it packs into L2
        on AMD CPUs, into L1 elsewhere; the same results); ``cpu_vendor``, ``cpu_family`` and
        ``cpu_model``, cpuid's vendor string and displayed family and model (``""``, 0, 0 off
        x86-64), and ``cpu``, the same as the measurements in docs/performance.md name it
        (``"AMD Zen 5 (family 0x1a, model 0x02)"``): the kernels choose by the vendor, the
        instruction sets and ``l2_cache_bytes``.

    Examples
    --------
    >>> import attnlab
    >>> attnlab.build_info()["isa"] in ("generic", "avx2", "avx512", "native")
    True
    """
    import os

    from ._loader import available

    info = dict(_core.build_info())
    info["module"] = os.path.basename(_core.__file__ or "")  # one module, every variant inside
    info["built_isas"] = list(info["built_isas"])
    info["available_isas"] = available()
    info["cpu_features"] = {k: bool(v) for k, v in dict(_core.cpu_features()).items()}
    info["cpu"] = _cpu_kind(
        info["cpu_vendor"],
        info["cpu_family"],
        info["cpu_model"],
        info["cpu_features"].get("avx512f", False),
    )
    return info
