"""Efficient additive attention (SwiftFormer).

It pools the tokens into one global vector and mixes it back into every token, so its cost is
linear in the number of tokens ``n`` (multi-head attention's is quadratic), as separable
self-attention's (:mod:`attnlab._separable`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from . import _args, _docs, _grad, _half, _memory
from . import _signature as _sig
from . import _validate as V
from ._loader import core

# layers.py and torch.py import separable_attention from here (to move to ._separable)
from ._separable import separable_attention as separable_attention

__all__ = ["additive_attention", "additive_attention_backward"]

_VARIANTS = {"official": 0, "hf": 1}


def _check_eps(eps: Any) -> float:
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a positive real number, got {type(eps).__name__}")
    e = float(eps)
    if not (math.isfinite(e) and e > 0):
        raise ValueError(f"eps: expected a positive finite number, got {e}")
    return e


def _variant_code(variant: Any) -> int:
    if isinstance(variant, str) and variant in _VARIANTS:
        return _VARIANTS[variant]
    raise ValueError(f"variant: expected 'official' or 'hf', got {variant!r}")


def _additive_state(a: dict[str, Any]) -> dict[str, np.ndarray]:
    """Buffers for what the additive forward keeps for attnlab.vjp (AdditiveState in
    cpp/include/attnlab/additive.hpp): (2 D + 3) values per token, D + 1 per batch element."""
    B, n, D, dtype = a["B"], a["n"], a["D"], a["dtype"]
    return _memory.empty_group(
        {
            "q": ((B * n, D), dtype),
            "k": ((B * n, D), dtype),
            "q_norm": ((B * n,), dtype),
            "k_norm": ((B * n,), dtype),
            "score": ((B * n,), dtype),
            "score_norm": ((B,), dtype),
            "pooled": ((B, D), dtype),
        }
    )


_WEIGHTS = ("w_q", "w_k", "w_g", "w_proj", "w_final")


def _prepare_additive(args: dict[str, Any], keep_half: np.dtype | None = None) -> dict[str, Any]:
    """Validated, converted arguments shared by the forward and the backward. ``keep_half``:
    ``x`` of that half dtype is passed as its bits (``options["half"]``, and ``half`` its dtype;
    not without features), and so are the weight matrices of that dtype."""
    code = _variant_code(args["variant"])
    e = _check_eps(args["eps"])
    xa = _args.pooled_tokens(args["x"], keep_half)
    n, d_in = xa.shape[-2:]
    keep_w = keep_half if _half.is_half(xa.dtype) else None
    ws = {k: V.as_array(args[k], k, None if k == "w_g" else keep_w) for k in _WEIGHTS}
    bs = {k: V.optional_array(args[k], k) for k in ("b_q", "b_k", "b_proj", "b_final")}
    # w_g, never kept, makes a kept half dtype float32
    dtype = V.result_dtype(xa, *ws.values(), *bs.values())
    wq_, wk_, wp_ = ws["w_q"], ws["w_k"], ws["w_proj"]
    for name, layout in (
        ("w_q", "(d_in, D)"),
        ("w_k", "(d_in, D)"),
        ("w_proj", "(D, D)"),
        ("w_final", "(D, d_out)"),
    ):
        V.check_matrix(ws[name], name, layout, 0 if name == "w_final" else 1)
    D_proj = wp_.shape[0] if wp_.shape[0] == wp_.shape[1] else None  # D as w_proj says
    readers = [
        V.reader(ws[n], n, f"(d_in, D) = ({d_in}, D)", lambda c: c == D_proj, d_in)
        for n in ("w_q", "w_k")
    ]
    V.check_readers([("x", xa, readers)], "from_swiftformer")
    if wk_.shape[1] != wq_.shape[1]:  # the odd one out, w_proj (D, D) deciding
        bad, good = ("w_q", wk_) if wk_.shape[1] == D_proj else ("w_k", wq_)
        raise ValueError(
            f"{bad}: expected shape (d_in, D) = ({d_in}, {good.shape[1]}) as "
            f"{'w_k' if bad == 'w_q' else 'w_q'} {V.shape_str(good.shape)}, got "
            f"{V.shape_str(ws[bad].shape)}"
        )
    D = wq_.shape[1]
    wq = _args.pooled_weight(wq_, "w_q", dtype, None, None, "(d_in, D)")
    wk = _args.pooled_weight(wk_, "w_k", dtype, None, None, "(d_in, D)")
    wg_ = ws["w_g"]
    if wg_.shape not in ((D,), (D, 1)):
        raise ValueError(f"w_g: expected shape ({D},) or ({D}, 1), got {V.shape_str(wg_.shape)}")
    wg = _memory.contiguous(wg_.reshape(D), dtype)
    wp = _args.pooled_weight(ws["w_proj"], "w_proj", dtype, D, D, f"(D, D) = ({D}, {D})")
    wf = _args.pooled_weight(ws["w_final"], "w_final", dtype, D, None, f"(D, d_out) = ({D}, d_out)")
    d_out = wf.shape[1]
    bq = V.vector(bs["b_q"], "b_q", dtype, D)
    bk = V.vector(bs["b_k"], "b_k", dtype, D)
    bp = V.vector(bs["b_proj"], "b_proj", dtype, D)
    bf = V.vector(bs["b_final"], "b_final", dtype, d_out)
    s = V.check_scale(args["scale"], d_out**-0.5 if d_out else 1.0)
    bf16 = V.precision_bf16(args["precision"], dtype)

    batch = tuple(xa.shape[:-2])
    kp = _args.pooled_padding(args, batch, n)
    B = V.count(batch)
    half = 0
    if d_in == 0:  # no features: x w = 0; one zero feature computes the same
        xr = _memory.zeros((B * n, 1), dtype)
        wq, wk = _memory.zeros((1, D), dtype), _memory.zeros((1, D), dtype)
    else:
        xr, half = _args.pooled_rows(xa, batch, dtype)
    # the arrays the kernels read, by argument name: the gradients take their names and shapes
    arrays = dict(
        x=xr, w_q=wq, b_q=bq, w_k=wk, b_k=bk, w_g=wg, w_proj=wp, b_proj=bp, w_final=wf, b_final=bf
    )
    return dict(
        x_shape=xa.shape,
        wg_shape=wg_.shape,
        arrays=arrays,
        B=B,
        n=n,
        d_in=d_in,
        D=D,
        d_out=d_out,
        batch=batch,
        dtype=dtype,
        # the other fields of core.AdditiveArgs
        options=dict(batch=B, n=n, scale=s, eps=e, variant=code, key_padding_mask=kp, half=half),
        half=xa.dtype if half else None,  # x's half dtype when x is passed as its bits
        bf16=bf16,  # precision="bf16"
    )


@_docs.filled
def additive_attention(
    x: Any,
    *,
    w_q: Any,
    b_q: Any = None,
    w_k: Any,
    b_k: Any = None,
    w_g: Any,
    w_proj: Any,
    b_proj: Any = None,
    w_final: Any,
    b_final: Any = None,
    scale: float | None = None,
    variant: str = "official",
    eps: float = 1e-12,
    key_padding_mask: Any = None,
    precision: str | None = None,
    warn_empty_rows: bool = True,
    _keep: dict[str, Any] | None = None,
) -> np.ndarray:
    """SwiftFormer's efficient additive attention, exactly as the official code computes it.

    Per batch element, with ``normalize(v) = v / max(||v||_2, eps)`` (as
    ``torch.nn.functional.normalize``)::

        Q = normalize(x w_q + b_q)            over the D features of each token
        K = normalize(x w_k + b_k)
        a = normalize((Q w_g) * scale)        over the n tokens: an L2 norm, not a softmax
        G = sum_n a_n Q_n                     (D,): the pooled global query
        out = ((G * K) w_proj + b_proj + Q) w_final + b_final

    The kernel never materialises ``G * K``: ``G`` is folded into ``w_proj`` per batch element
    (``diag(G) w_proj``), so time and memory are linear in ``n``.

    Parameters
    ----------
    x : array_like, shape (..., n, d_in)
        Tokens; any number of leading batch dimensions. SwiftFormer's (B, C, H, W) feature maps
        become tokens with ``x = fmap.transpose(0, 2, 3, 1).reshape(B, H * W, C)``.
    w_q, w_k : array_like, shape (d_in, D)
        ``to_query`` / ``to_key`` weights as ``(in, out)`` (``nn.Linear.weight.T``).
    b_q, b_k : array_like, shape (D,), optional
    w_g : array_like, shape (D,) or (D, 1)
        The learned global attention vector.
    w_proj : array_like, shape (D, D)
        ``Proj`` (``proj`` in Hugging Face). ``b_proj`` (D,), optional.
    w_final : array_like, shape (D, d_out)
        ``final``. ``b_final`` (d_out,), optional. The official module has
        ``D = token_dim * num_heads`` and ``d_out = token_dim``.
    scale : float, optional
        Multiplies the scores; defaults to ``d_out ** -0.5`` (``token_dim ** -0.5`` in the
        official code). Since the scores are then L2-normalised over the tokens, a positive
        scale only matters when the scores' norm is below ``eps``; its sign flips ``G``.
    variant : {"official", "hf"}
        ``"official"``: Amshaker/SwiftFormer after July 2023, the normalisation above. Use it
        with the checkpoints linked from the official README and with timm's
        ``swiftformer_*`` (timm's port computes the same; its PR #2499 reproduces the paper's
        accuracy with those weights).
        ``"hf"``: the Hugging Face ``transformers`` port (``SwiftFormerEfficientAdditiveAttention``,
        checkpoints ``MBZUAI/swiftformer-*``) and the original March 2023 release, whose
        ``softmax(dim=-1)`` over a singleton axis makes every token weight 1: ``G = sum_n Q_n``,
        and ``w_g`` and ``scale`` have no effect (``w_g`` is still required and checked).
    eps : float
        The floor of every norm (default 1e-12, torch's).
    key_padding_mask : array_like of bool, shape (..., n), optional
        ``True`` for real tokens. Padded tokens are left out of the pooling (of the scores'
        norm and of ``G``), so a padded batch gives the real tokens exactly the output of the
        unpadded one; padded tokens still get an output row (computed with that ``G``). Neither
        original offers this; it serves variable-length batches. ``nn.MultiheadAttention``'s
        ``key_padding_mask`` means the opposite (``True`` = padding): convert it with
        :func:`attnlab.interop.torch_masks`.
    precision : {None, "bf16"}, optional
        ``None``: exact in the input dtype. ``"bf16"`` (float32 or half-precision inputs): the
        four weight products as the form above writes them, ``x w_q``, ``x w_k``,
        ``(G * K) w_proj`` and ``H w_final`` with ``H = (G * K) w_proj + b_proj + Q``, on
        operands rounded to bfloat16 (round to nearest even, subnormals to zero) and summed
        in float32 (``VDPBF16PS`` or AMX tiles where the CPU has them,
        ``build_info()["bf16_kernel"]``, else emulated); the biases, the norms, the scores
        ``Q w_g`` and the pooling in float32 (``G`` is not folded into ``w_proj`` then).
        :func:`attnlab.reference.additive_attention` rounds the same operands in float64.
        The error against the exact result is of the order of bfloat16's unit roundoff
        ``2**-8``, relative (``docs/guide.md``, "Precision"). Gradients (``*_backward``,
        ``vjp``) are those of the float32 attention at ``x``, ``w_q``, ``w_k``, ``w_proj``
        and ``w_final`` rounded to bfloat16 (``vjp``'s pullback recomputes them).
    warn_empty_rows : bool
        Warn (a ``UserWarning``, once per call, with the count) when ``key_padding_mask``
        leaves a sequence with no real token: the usual sign of a mask in PyTorch's polarity.
        Pass ``False`` when such sequences are intended.

    Returns
    -------
    out : ndarray, shape (..., n, d_out)

    Notes
    -----
    A batch element with no real token pools nothing: ``G = 0``, so every output row is
    ``(Q_n + b_proj) w_final + b_final``; never NaN. With ``n = 1`` the official token weight
    is ``s / max(|s|, eps)``, the sign of the score ``s`` (0 when ``|s|`` is tiny).
    NaN or Inf in real tokens propagate to the whole batch element (through ``G``).
    {dtypes_mixed}

    {examples}
    >>> d = 8
    >>> w = {k: rng.standard_normal((d, d)) * 0.3 for k in ("w_q", "w_k", "w_proj", "w_final")}
    >>> x = rng.standard_normal((2, 49, d))
    >>> attnlab.additive_attention(x, w_g=rng.standard_normal(d), **w).shape
    (2, 49, 8)
    """
    args = _sig.arguments(locals())
    half = _half.storage(args)
    # half-precision x and weight matrices are read, and out written, as stored (no float32
    # copies of them; the state attnlab.vjp keeps is float32)
    a = _prepare_additive(args, half)
    B, n, d_out = a["B"], a["n"], a["d_out"]
    bits = a["options"]["half"] != 0
    out = _memory.empty((B * n, d_out), half if bits else a["dtype"])
    state = None
    if _keep is not None:  # attnlab.vjp: keep the pooling's intermediates for the pullback
        a = _memory.owned(a)
        state = _additive_state(a)
        _keep.update(prepared=a, state=state, halves=_half.halves(args))
    if out.size:
        core.additive_forward(
            core.AdditiveArgs(**a["arrays"], **a["options"]),
            out.view(np.uint16) if bits else out,
            state,
            a["bf16"],
        )
    batch = a["batch"]
    return _half.store(out.reshape(batch + (n, d_out)), half)


_ADDITIVE_BACKWARD_DOC = """\
    x, w_q, b_q, w_k, b_k, w_g, w_proj, b_proj, w_final, b_final, scale, variant, eps,
    key_padding_mask, precision, warn_empty_rows
        As for :func:`additive_attention`
        {padding_polarity}

    Returns
    -------
    dict
        Keyed by argument name: ``"x"``, ``"w_q"``, ``"w_k"``, ``"w_g"`` (shaped as given),
        ``"w_proj"``, ``"w_final"`` and each bias given. With ``variant="hf"`` the gradient of
        ``w_g`` is all zeros (``w_g`` has no effect there). ``scale``, ``eps`` and the mask are
        not differentiated. Below ``eps`` a norm is treated as torch's autograd treats
        ``F.normalize``: ``v / eps``, a constant scale.

    {examples}
    >>> w = {k: rng.standard_normal((8, 8)) * 0.3 for k in ("w_q", "w_k", "w_proj", "w_final")}
    >>> x = rng.standard_normal((49, 8))
    >>> g = attnlab.additive_attention_backward(np.ones((49, 8)), x, w_g=np.ones(8), **w)
    >>> sorted(g)
    ['w_final', 'w_g', 'w_k', 'w_proj', 'w_q', 'x']
    """


def _additive_backward(grad_out: Any, args: dict[str, Any]) -> dict[str, np.ndarray]:
    # half-precision x, weight matrices (and grad_out) read, and x's gradient written, as
    # stored; precision="bf16" differentiates the float32 function at x and the matrices
    # rounded to bfloat16: bfloat16 ones are their own rounding (without subnormals and NaN),
    # others are widened and rounded first
    rounded = ("x", "w_q", "w_k", "w_proj", "w_final")
    own = args["precision"] is not None and _half.own_bf16_rounding(args, rounded)
    half = _half.storage(args) if args["precision"] is None or own else None
    a = _prepare_additive(args, half)
    if a["bf16"] and not own:
        a["arrays"] = _args.pooled_bf16_operands(a["arrays"], rounded)
    return _half.store_grads(_additive_grads(a, grad_out), _half.halves(args))


def _additive_grads(
    a: dict[str, Any], grad_out: Any, state: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """The gradients of a prepared call; with ``state`` (what the forward kept for
    attnlab.vjp) the kernel reads it instead of running the forward's pooling again. A call
    prepared with half-precision x (``options["half"]``) reads x, and ``grad_out`` when it is
    stored in x's dtype, as stored, and writes x's gradient in that dtype."""
    B, n, d_in, D, d_out, dtype = a["B"], a["n"], a["d_in"], a["D"], a["d_out"], a["dtype"]
    half = a["half"]
    go = _grad.grad_out_rows(grad_out, a["batch"] + (n, d_out), dtype, keep=half)
    # as the kernel reads them: x, w_q and w_k with one zero feature when d_in == 0; not
    # zeroed when the kernel runs (it writes every element)
    run = B * n > 0 and d_out > 0
    grads = _grad.grad_buffers(a["arrays"], dtype, zeroed=not run)
    if half is not None:  # x's gradient as its bits
        grads["x"] = _half.bits((_memory.empty if run else _memory.zeros)((B * n, d_in), half))
    if run:
        core.additive_backward(go, core.AdditiveArgs(**a["arrays"], **a["options"]), grads, state)
    if d_in == 0:
        grads["x"] = _memory.zeros((B * n, 0), dtype)
        grads["w_q"] = _memory.zeros((0, D), dtype)
        grads["w_k"] = _memory.zeros((0, D), dtype)
    grads["x"] = _half.from_bits(grads["x"], half).reshape(a["x_shape"])
    grads["w_g"] = grads["w_g"].reshape(a["wg_shape"])
    return grads


additive_attention_backward = _sig.backward_of(
    additive_attention, _additive_backward, "(..., n, d_out)", _ADDITIVE_BACKWARD_DOC
)
