# Stub of the compiled module attnlab._core (cpp/bindings/*.cpp), as `attnlab._loader.core`
# exposes it. One module: the kernels inside are compiled once per instruction set and the
# variant is chosen at import (ISA; ATTNLAB_ISA forces one). Private: the Python layer
# validates and prepares every argument (dtype float32/float64 shared by all arrays,
# C-contiguous or whole-element strides, outputs writable) and the bindings check the raw
# buffers again. Optional arrays are `None` when absent.

from dataclasses import dataclass
from typing import Any, SupportsFloat, SupportsIndex, SupportsInt, TypeAlias

import numpy.typing as npt

from ._args import CoreMask

_Array: TypeAlias = npt.NDArray[Any]
_Optional: TypeAlias = npt.NDArray[Any] | None
_Int: TypeAlias = SupportsInt | SupportsIndex
_Float: TypeAlias = SupportsFloat | SupportsIndex
# The mask options, one argument of every function that masks: the tuple that
# attnlab._args.Masks.core_mask builds and MaskArgs (cpp/bindings/common.hpp) reads, so that a
# new mask option does not change these signatures.
_Mask: TypeAlias = CoreMask

__version__: str
ISA: str  # the variant in use: "generic", "avx2", "avx512" or "native"
BUILT_ISAS: tuple[str, ...]  # the variants compiled into the module, best first
MAX_THREADS: int

def cpu_features() -> dict[str, bool]: ...
def isa_supported(isa: str) -> bool: ...
def get_num_threads() -> int: ...
def copy_arrays(pairs: list[tuple[_Array, _Array]]) -> None: ...

# Half-precision bits (uint16 views; half: 1 float16, 2 bfloat16) to float32 and back,
# elementwise on the thread pool (cpp/bindings/half.cpp).
def widen_half(src: _Array, dst: _Array, half: _Int) -> None: ...
def narrow_half(src: _Array, dst: _Array, half: _Int) -> None: ...
def bf16_special(bits: _Array) -> bool: ...  # bfloat16 bits holding a subnormal or a NaN
def set_num_threads(n: _Int) -> None: ...
def cgroup_cpu_limit(sysroot: str) -> int: ...
def build_info() -> dict[str, Any]: ...

# float32 FMA peak of the variant in use, measured for `seconds` on every pool thread
# (cpp/src/kernels/peak.cpp): (GFLOP/s of all threads over the wall time, [GFLOP/s of each
# thread over its wall time], [GFLOP/s of each thread over its CPU time; 0 without a per-thread
# clock]).
def fma_peak(seconds: _Float) -> tuple[float, list[float], list[float]]: ...

# Multi-head attention (cpp/bindings/mha.cpp).
def sdpa_forward(
    q: _Array,
    k: _Array,
    v: _Array,
    out: _Array,
    mask: _Mask,
    scale: _Float,
    weights: _Optional,
    lse: _Optional,
    bf16: bool = ...,
) -> None: ...
def sdpa_forward_half(
    q: _Array,  # bits of k's format, or float32 (out then float32)
    k: _Array,
    v: _Array,
    half: _Int,
    out: _Array,
    mask: _Mask,
    scale: _Float,
    lse: _Optional,
    weights: _Optional = ...,
    bf16: bool = ...,
) -> None: ...
def mha_bf16_fused_calls() -> int: ...  # calls of the fused bf16 MHA forward (for the tests)
def attention_copied_calls() -> int: ...  # attention forwards on contiguous K/V copies (tests)
def mha_forward(
    args: MhaArgs,
    out: _Array,
    weights: _Optional,
    state: dict[str, _Array] | None = ...,
    bf16: bool = ...,
    qk: QkArgs | None = ...,
) -> None: ...
def sdpa_backward(
    grad_out: _Array,
    q: _Array,
    k: _Array,
    v: _Array,
    mask: _Mask,
    scale: _Float,
    out: _Array,
    lse: _Array,
    d_q: _Array,
    d_k: _Array,
    d_v: _Array,
    recompute: bool = ...,
    d_mask: _Optional = ...,
    d_sinks: _Optional = ...,
    bf16: bool = ...,
) -> None: ...
def sdpa_backward_half(
    grad_out: _Array,
    q: _Array,
    k: _Array,
    v: _Array,
    half: _Int,
    mask: _Mask,
    scale: _Float,
    out: _Array,
    lse: _Array,
    d_q: _Array,
    d_k: _Array,
    d_v: _Array,
    grad_out_half: bool,
    recompute: bool = ...,
    d_mask: _Optional = ...,
    d_sinks: _Optional = ...,
    bf16: bool = ...,
) -> None: ...
def merge_parts(parts: list[_Array], half: _Int, frac: _Array, out: _Array) -> None: ...
def mha_backward(
    grad_out: _Array,
    args: MhaArgs,
    grads: dict[str, _Array],
    state: dict[str, _Array] | None = ...,
    qk: QkArgs | None = ...,
    bf16: bool = ...,
) -> None: ...
def linear_backward(
    x: _Array,
    w: _Array,
    dy: _Array,
    dx: _Optional,
    dw: _Optional,
    db: _Optional,
    accumulate: bool = ...,
    half: _Int = ...,  # 1 / 2: x, w, dy given as uint16 read as float16 / bfloat16 bits
) -> None: ...
def linear_forward(
    x: _Array,
    w: _Array,
    b: _Optional,
    y: _Array,
    bf16: bool = ...,
    w_half: int = ...,
    x_half: bool = ...,  # x as bits of w_half's format (uint16)
    y_half: bool = ...,  # y as bits of that format
    packed: _Optional = ...,  # pack_weight(w), float weights and products only
) -> None: ...
def pack_weight(w: _Array) -> _Array: ...  # w's whole column panels as linear reads them
def pack_bf16_tiles(w: _Array) -> _Array | None: ...  # float32 w as precision="bf16" reads it

# Bilinear-collapsed attention (cpp/bindings/bilinear.cpp). order: 0 query, 1 key.
def bilinear_forward(
    args: BilinearArgs,
    order: _Int,
    out: _Array,
    weights: _Optional,
    state: dict[str, _Array] | None = ...,
) -> None: ...
def bilinear_backward(
    grad_out: _Array,
    args: BilinearArgs,
    grads: dict[str, _Array],
    state: dict[str, _Array] | None = ...,
) -> None: ...

# Additive (SwiftFormer) and separable (MobileViT-v2) attention (cpp/bindings/additive.cpp,
# separable.cpp). state: attnlab.vjp's buffers (AdditiveState, SeparableState), filled by the
# forward, read by the backward.
def additive_forward(
    args: AdditiveArgs, out: _Array, state: dict[str, _Array] | None = ..., bf16: bool = ...
) -> None: ...
def separable_forward(
    args: SeparableArgs, out: _Array, state: dict[str, _Array] | None = ..., bf16: bool = ...
) -> None: ...
def additive_backward(
    grad_out: _Array,
    args: AdditiveArgs,
    grads: dict[str, _Array],
    state: dict[str, _Array] | None = ...,
) -> None: ...
def separable_backward(
    grad_out: _Array,
    args: SeparableArgs,
    grads: dict[str, _Array],
    state: dict[str, _Array] | None = ...,
) -> None: ...

# The argument objects of the families' forward and backward (bind_args in
# cpp/bindings/common.hpp): built with every field by keyword, read by name in C++, each field
# a read-only attribute. Declared as frozen keyword-only dataclasses so that mypy derives the
# constructor from the fields; the runtime classes are pybind11 classes, not dataclasses.
@dataclass(frozen=True, kw_only=True)
class _SharedArgs:
    """The fields multi-head and bilinear attention share (SharedArgs)."""

    w_v: _Array
    b_v: _Optional
    w_o: _Array
    b_o: _Optional
    batch: _Int
    n_q: _Int
    n_k: _Int
    heads: _Int
    kv_heads: _Int
    mask: _Mask
    scale: _Float

@dataclass(frozen=True, kw_only=True)
class MhaArgs(_SharedArgs):
    """Rows (batch * n, d) of query, key and value, and the query-key projections."""

    query: _Array
    key: _Array
    value: _Array
    w_q: _Array
    b_q: _Optional
    w_k: _Array
    b_k: _Optional
    weights_half: _Int  # 0; 1 or 2: the four weights as float16 or bfloat16 bits (uint16)
    inputs_half: _Int  # 0; 1: query, key, value and mha_forward's out as bits of weights_half
    # None, or pack_weight's panels (bf16 products: pack_bf16_tiles') or None for each of w_q,
    # w_k, w_v, w_o
    packed: tuple[_Optional, _Optional, _Optional, _Optional] | None

@dataclass(frozen=True, kw_only=True)
class QkArgs:
    """Per-head q/k RMSNorm weights (d_head,) and rotary tables (1 or batch, n, rope_dim / 2)
    in the call's dtype (float32 with half-precision inputs); rope_dim 0: no rotation."""

    q_norm: _Optional
    k_norm: _Optional
    norm_eps: float
    rope_dim: _Int
    cos_q: _Optional
    sin_q: _Optional
    cos_k: _Optional
    sin_k: _Optional

@dataclass(frozen=True, kw_only=True)
class BilinearArgs(_SharedArgs):
    """Rows (batch * n, d) of query, key and value, and the collapsed query-key weights."""

    query: _Array
    key: _Array
    value: _Array
    w_qk: _Array
    u_k: _Optional
    weights_half: _Int  # 0, or 1 / 2: w_qk, w_v, w_o as float16 / bfloat16 bits
    inputs_half: _Int  # 1: query, key, value (and the forward's out) as bits of that format

@dataclass(frozen=True, kw_only=True)
class AdditiveArgs:
    """variant: 0 official, 1 hf. half (both families): 0, or 1 / 2 when x (and the forward's
    out) are float16 / bfloat16 bits (uint16 arrays), computed in float32; any weight matrix may
    be given as such bits too (not to the bf16 forward; the vectors stay float32)."""

    x: _Array
    w_q: _Array
    b_q: _Optional
    w_k: _Array
    b_k: _Optional
    w_g: _Array
    w_proj: _Array
    b_proj: _Optional
    w_final: _Array
    b_final: _Optional
    batch: _Int
    n: _Int
    scale: _Float
    eps: _Float
    variant: _Int
    key_padding_mask: _Optional
    half: _Int

@dataclass(frozen=True, kw_only=True)
class SeparableArgs:
    x: _Array
    w_qkv: _Array
    b_qkv: _Optional
    w_o: _Array
    b_o: _Optional
    batch: _Int
    n: _Int
    key_padding_mask: _Optional
    half: _Int
