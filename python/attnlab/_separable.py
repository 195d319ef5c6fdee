"""Separable self-attention (MobileViT-v2).

It pools the tokens into one context vector (a softmax over the tokens) and mixes it back into
every token, so its cost is linear in the number of tokens ``n``, as efficient additive
attention's (:mod:`attnlab._additive`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _args, _docs, _grad, _half, _memory
from . import _signature as _sig
from . import _validate as V
from ._loader import core

__all__ = ["separable_attention", "separable_attention_backward"]


def _separable_state(a: dict[str, Any]) -> dict[str, np.ndarray]:
    """Buffers for what the separable forward keeps for attnlab.vjp (SeparableState in
    cpp/include/attnlab/additive.hpp): 2 d + 1 values per token, d per batch element."""
    B, n, d, dtype = a["B"], a["n"], a["d"], a["dtype"]
    return _memory.empty_group(
        {
            "s": ((B * n,), dtype),
            "k": ((B * n, d), dtype),
            "v": ((B * n, d), dtype),
            "context": ((B, d), dtype),
        }
    )


def _prepare_separable(args: dict[str, Any], keep_half: np.dtype | None = None) -> dict[str, Any]:
    """Validated, converted arguments shared by the forward and the backward. ``keep_half``:
    ``x`` of that half dtype is passed as its bits (``options["half"]``, and ``half`` its dtype;
    not without features), and so are the weight matrices of that dtype."""
    xa = _args.pooled_tokens(args["x"], keep_half)
    n, d = xa.shape[-2:]
    keep_w = keep_half if _half.is_half(xa.dtype) else None
    wqkv_ = V.as_array(args["w_qkv"], "w_qkv", keep_w)
    wo_ = V.as_array(args["w_o"], "w_o", keep_w)
    bqkv_ = V.optional_array(args["b_qkv"], "b_qkv")
    bo_ = V.optional_array(args["b_o"], "b_o")
    dtype = V.result_dtype(xa, wqkv_, wo_, bqkv_, bo_)
    if _half.is_half(dtype):  # every array kept in half precision: computed in float32
        dtype = np.dtype(np.float32)
    V.check_matrix(wqkv_, "w_qkv", "(d, 1 + 2 d)")
    V.check_matrix(wo_, "w_o", "(d, d_out)", 0)
    # its own shape, as long as it is not (out, in)
    if wqkv_.shape[1] != 1 + 2 * wqkv_.shape[0] and wqkv_.shape[0] != 1 + 2 * wqkv_.shape[1]:
        r = wqkv_.shape[0]
        raise ValueError(
            f"w_qkv: expected shape (d, 1 + 2 d) = ({r}, {1 + 2 * r}), got "
            f"{V.shape_str(wqkv_.shape)}"
        )
    readers = [
        V.reader(wqkv_, "w_qkv", f"(d, 1 + 2 d) = ({d}, {1 + 2 * d})", lambda c: c == 1 + 2 * d, d)
    ]
    V.check_readers([("x", xa, readers)], "from_mobilevitv2")
    wqkv = _args.pooled_weight(wqkv_, "w_qkv", dtype, None, None, "(d, 1 + 2 d)")
    if wo_.shape[0] != d:  # w_o reads the d value features
        r_o = V.reader(wo_, "w_o", f"(d, d_out) = ({d}, d_out)", lambda _c: True, d)
        if r_o.transposed_fits:
            raise V.transposed(r_o, "from_mobilevitv2")
        raise ValueError(f"w_o: expected shape {r_o.layout}, got {V.shape_str(wo_.shape)}")
    wo = _args.pooled_weight(wo_, "w_o", dtype, None, None, "(d, d_out)")
    d_out = wo.shape[1]
    bqkv = V.vector(bqkv_, "b_qkv", dtype, 1 + 2 * d)
    bo = V.vector(bo_, "b_o", dtype, d_out)
    bf16 = V.precision_bf16(args["precision"], dtype)

    batch = tuple(xa.shape[:-2])
    kp = _args.pooled_padding(args, batch, n)
    B = V.count(batch)
    # the kernel's rows (none without features: the kernel is not called)
    xr, half = _args.pooled_rows(xa, batch, dtype) if d else (None, 0)
    return dict(
        x_shape=xa.shape,
        # the arrays the kernels read, by argument name: the gradients take their names
        arrays=dict(x=xr, w_qkv=wqkv, b_qkv=bqkv, w_o=wo, b_o=bo),
        B=B,
        n=n,
        d=d,
        d_out=d_out,
        batch=batch,
        dtype=dtype,
        # the other fields of core.SeparableArgs
        options=dict(batch=B, n=n, key_padding_mask=kp, half=half),
        half=xa.dtype if half else None,  # x's half dtype when x is passed as its bits
        bf16=bf16,  # precision="bf16"
    )


@_docs.filled
def separable_attention(
    x: Any,
    *,
    w_qkv: Any,
    b_qkv: Any = None,
    w_o: Any,
    b_o: Any = None,
    key_padding_mask: Any = None,
    precision: str | None = None,
    warn_empty_rows: bool = True,
    _keep: dict[str, Any] | None = None,
) -> np.ndarray:
    """MobileViT-v2's separable self-attention (``LinearSelfAttention``) on tokens.

    Per batch element, with ``[s | k | v] = x w_qkv + b_qkv`` split into widths 1, d, d::

        c = softmax over the n tokens of s         (n,): the context scores
        ctx = sum_n c_n k_n                        (d,): the context vector
        out = (relu(v) * ctx) w_o + b_o

    ``ctx`` is folded into ``w_o`` per batch element (``diag(ctx) w_o``): linear in ``n``.
    The original's ``attn_dropout`` on ``c`` is the identity at inference and is not applied.

    Parameters
    ----------
    x : array_like, shape (..., n, d)
        Tokens; any number of leading batch dimensions. MobileViT-v2 works on unfolded feature
        maps ``(B, C, P, N)`` (P pixels per patch, N patches) and attends over the N patches
        separately for every pixel position P: treat P as a batch dimension,
        ``x = fmap.transpose(0, 2, 3, 1)`` of shape (B, P, N, C), and transpose the result back
        with ``out.transpose(0, 3, 1, 2)``.
    w_qkv : array_like, shape (d, 1 + 2 d)
        ``qkv_proj`` (a 1x1 convolution) as ``(in, out)``: ``conv.weight[:, :, 0, 0].T``.
        Column 0 gives the scores, columns 1..d the keys, the last d the values.
    b_qkv : array_like, shape (1 + 2 d,), optional
    w_o : array_like, shape (d, d_out)
        ``out_proj`` as ``(in, out)`` (d_out = d in MobileViT-v2). ``b_o`` (d_out,), optional.
    key_padding_mask : array_like of bool, shape (..., n), optional
        ``True`` for real tokens; padded tokens are left out of the softmax and of ``ctx`` (an
        addition: the original has no mask). Padded tokens still get an output row.
        ``nn.MultiheadAttention``'s ``key_padding_mask`` means the opposite (``True`` =
        padding): convert it with :func:`attnlab.interop.torch_masks`.
    precision : {None, "bf16"}, optional
        ``None``: exact in the input dtype. ``"bf16"`` (float32 or half-precision inputs): the
        two weight products as the form above writes them, ``x w_qkv`` and
        ``(relu(v) * ctx) w_o``, on operands rounded to bfloat16 (round to nearest even,
        subnormals to zero) and summed in float32 (``VDPBF16PS`` or AMX tiles where the CPU
        has them, ``build_info()["bf16_kernel"]``, else emulated); the biases, the softmax and
        ``ctx`` in float32 (``ctx`` is not folded into ``w_o`` then).
        :func:`attnlab.reference.separable_attention` rounds the same operands in float64. The
        error against the exact result is of the order of bfloat16's unit roundoff ``2**-8``,
        relative (``docs/guide.md``, "Precision"). Gradients (``*_backward``, ``vjp``) are
        those of the float32 attention at ``x``, ``w_qkv`` and ``w_o`` rounded to bfloat16
        (``vjp``'s pullback recomputes them).
    warn_empty_rows : bool
        Warn (a ``UserWarning``, once per call, with the count) when ``key_padding_mask``
        leaves a sequence with no real token. Pass ``False`` when such sequences are intended.

    Returns
    -------
    out : ndarray, shape (..., n, d_out)

    Notes
    -----
    A batch element with no real token has ``ctx = 0``, so every output row is ``b_o``; never
    NaN. NaN in a real token's score makes its whole batch element NaN, as in torch.
    {dtypes_mixed}

    {examples}
    >>> B, C, P, N = 2, 8, 4, 16                      # MobileViT-v2's unfolded map
    >>> fmap = rng.standard_normal((B, C, P, N))
    >>> w_qkv = rng.standard_normal((C, 1 + 2 * C)) * 0.3
    >>> w_o = rng.standard_normal((C, C)) * 0.3
    >>> out = attnlab.separable_attention(fmap.transpose(0, 2, 3, 1), w_qkv=w_qkv, w_o=w_o)
    >>> out.transpose(0, 3, 1, 2).shape               # back to (B, C, P, N)
    (2, 8, 4, 16)
    """
    args = _sig.arguments(locals())
    half = _half.storage(args)
    # half-precision x and weight matrices are read, and out written, as stored (no float32
    # copies of them; the state attnlab.vjp keeps is float32)
    a = _prepare_separable(args, half)
    B, n, d, d_out = a["B"], a["n"], a["d"], a["d_out"]
    batch, dtype = a["batch"], a["dtype"]
    bits = a["options"]["half"] != 0
    out = _memory.empty((B * n, d_out), half if bits else dtype)
    state = None
    if _keep is not None:  # attnlab.vjp: keep the pooling's intermediates for the pullback
        a = _memory.owned(a)
        state = _separable_state(a)
        _keep.update(prepared=a, state=state, halves=_half.halves(args))
    bo = a["arrays"]["b_o"]
    if out.size:
        if d == 0:  # no features: no keys or values, ctx is empty and out = b_o
            out[...] = 0.0 if bo is None else bo
        else:
            core.separable_forward(
                core.SeparableArgs(**a["arrays"], **a["options"]),
                out.view(np.uint16) if bits else out,
                state,
                a["bf16"],
            )
    return _half.store(out.reshape(batch + (n, d_out)), half)


_SEPARABLE_BACKWARD_DOC = """\
    x, w_qkv, b_qkv, w_o, b_o, key_padding_mask, precision, warn_empty_rows
        As for :func:`separable_attention`
        {padding_polarity}

    Returns
    -------
    dict
        Keyed by argument name: ``"x"``, ``"w_qkv"``, ``"w_o"`` and each bias given. The mask
        is not differentiated; relu's gradient at 0 is 0, as torch's.

    {examples}
    >>> x = rng.standard_normal((16, 8))
    >>> w_qkv, w_o = rng.standard_normal((8, 17)) * 0.3, rng.standard_normal((8, 8)) * 0.3
    >>> g = attnlab.separable_attention_backward(np.ones((16, 8)), x, w_qkv=w_qkv, w_o=w_o)
    >>> sorted(g)
    ['w_o', 'w_qkv', 'x']
    """


def _separable_backward(grad_out: Any, args: dict[str, Any]) -> dict[str, np.ndarray]:
    # half-precision x, weight matrices (and grad_out) read, and x's gradient written, as
    # stored; precision="bf16" as in additive attention's backward
    rounded = ("x", "w_qkv", "w_o")
    own = args["precision"] is not None and _half.own_bf16_rounding(args, rounded)
    half = _half.storage(args) if args["precision"] is None or own else None
    a = _prepare_separable(args, half)
    if a["bf16"] and not own:
        a["arrays"] = _args.pooled_bf16_operands(a["arrays"], rounded)
    return _half.store_grads(_separable_grads(a, grad_out), _half.halves(args))


def _separable_grads(
    a: dict[str, Any], grad_out: Any, state: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """As :func:`_additive_grads`, for a prepared separable call."""
    B, n, d, d_out, dtype = a["B"], a["n"], a["d"], a["d_out"], a["dtype"]
    half = a["half"]
    go = _grad.grad_out_rows(grad_out, a["batch"] + (n, d_out), dtype, keep=half)
    params = {k: v for k, v in a["arrays"].items() if k != "x"}
    # zeroed unless the kernel runs (it writes every element); x's rows are absent without
    # features: (B * n, 0); half-precision x: its gradient as its bits
    run = B * n > 0 and d_out > 0 and d > 0
    new = _memory.empty if run else _memory.zeros
    grads = {"x": _half.bits(new((B * n, d), dtype if half is None else half))}
    grads.update(_grad.grad_buffers(params, dtype, zeroed=not run))
    if B * n > 0 and d_out > 0:
        if d == 0:  # out = b_o
            if params["b_o"] is not None:
                grads["b_o"] = go.sum(axis=0)
        else:
            core.separable_backward(
                go, core.SeparableArgs(**a["arrays"], **a["options"]), grads, state
            )
    grads["x"] = _half.from_bits(grads["x"], half).reshape(a["x_shape"])
    return grads


separable_attention_backward = _sig.backward_of(
    separable_attention, _separable_backward, "(..., n, d_out)", _SEPARABLE_BACKWARD_DOC
)
