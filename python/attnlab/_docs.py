"""Docstring text several public functions share word for word, written once.

A docstring names a fragment on a line of its own, ``{name}``; :func:`filled` puts the
fragment there, indented as that line. The text users read is unchanged."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__: list[str] = []  # private module

F = TypeVar("F", bound=Callable[..., Any])

FRAGMENTS = {
    # attnlab's dtype rule, as the Notes of the families state it
    "dtypes_mixed": (
        "float32 and float64 are computed natively and the result keeps that dtype; mixed inputs\n"
        "follow ``np.result_type`` (float32 with float64 gives float64). float16 and bfloat16\n"
        "(``ml_dtypes``) are computed in float32 and the results stored in that dtype when every\n"
        "input has it (gradients in the dtype of their argument; the log-sum-exp in float32);\n"
        "ints become float64; bool, complex, object and string data raise ``TypeError``."
    ),
    # precision= of the attention core
    "precision_core": (
        'precision : {None, "bf16"}, optional\n'
        '    ``None``: exact in the input dtype. ``"bf16"`` (float32 or half inputs): ``q``,\n'
        "    ``k``, ``v`` rounded to bfloat16, the scores and the context summed in float32, the\n"
        "    softmax statistics in float32 and the probabilities rounded to bfloat16 for their\n"
        "    product with ``v``: on AMX tiles, or ``VDPBF16PS`` on AMD CPUs with AVX512-BF16\n"
        '    (``build_info()["bf16_kernel"]``), and emulated elsewhere; they agree within\n'
        "    ``2**-8 max|v|`` (a probability may\n"
        "    round to the neighbouring bfloat16 where the running maximum moves at another key\n"
        "    or by the AMX kernel's exponential, a polynomial within 3e-6 relative). The\n"
        "    error against the exact result is of the order of bfloat16's unit roundoff\n"
        "    ``2**-8``, relative (the bound is stated in ``docs/guide.md``). Gradients are\n"
        "    those of the float32 attention at the rounded ``q``, ``k``, ``v`` (probabilities\n"
        "    unrounded; ``attnlab.vjp``'s pullback recomputes that forward)."
    ),
    # the inputs of the query/key/value families, key and value defaulting as they do
    "query_key_value": (
        "query : array_like, shape (..., n_q, d_q)\n"
        "key : array_like, shape (..., n_k, d_k), optional\n"
        "    Defaults to ``query``.\n"
        "value : array_like, shape (..., n_k, d_v), optional\n"
        "    Defaults to ``key``."
    ),
    # what the query/key/value families return (multi-head and bilinear attention)
    "attention_returns": (
        "Returns\n-------\nout : ndarray, shape (..., n_q, d_out)\nweights : ndarray, optional"
    ),
    # the polarity of the masks, as the backwards state it after "As for <forward>"
    "mask_polarity": (
        "(boolean ``True`` = *may attend*, the opposite of ``nn.MultiheadAttention``'s masks;\n"
        "see :func:`attnlab.interop.torch_masks`)."
    ),
    "padding_polarity": (
        "(``True`` = real token, the opposite of ``nn.MultiheadAttention``'s\n"
        "``key_padding_mask``; see :func:`attnlab.interop.torch_masks`)."
    ),
    # the options of today's models, shared by SDPA, multi-head and bilinear attention
    "window": (
        "window : (int or None, int or None), optional\n"
        "    Sliding window ``(left, right)``: query ``i`` sees keys ``j`` with\n"
        "    ``p(i) - left <= j <= p(i) + right``, where ``p(i)`` is the key it is aligned\n"
        '    with (``i + n_k - n_q`` for ``causal="bottom_right"``, else ``i``); ``None`` leaves\n'
        "    a side unbounded. Combined with the masks and ``causal`` (all must allow a pair).\n"
        "    Key tiles outside the band are skipped, so the cost is O(n * window).\n"
        "    ``transformers``'\n"
        "    ``sliding_window=w`` (Mistral, Gemma 2/3, gpt-oss) is ``window=(w - 1, 0)`` with\n"
        "    ``causal=True``."
    ),
    "logit_options": (
        "softcap : float, optional\n"
        "    Logit soft-capping (Gemma 2's ``attn_logit_softcapping``): the scaled scores ``s``\n"
        "    become ``softcap * tanh(s / softcap)`` before the masks and biases are added.\n"
        "alibi_slopes : array_like, shape (h,) or (..., h), optional\n"
        "    ALiBi (BLOOM, MPT, Falcon): adds ``-slope * |p(i) - j|`` to the logits of query\n"
        "    ``i`` and key ``j``, ``p(i)`` the key it is aligned with (FlashAttention's\n"
        "    convention; BLOOM's ``slope * j`` differs by a per-row constant, which the softmax\n"
        "    cancels). Not differentiated.\n"
        "sinks : array_like, shape (h,) or (..., h), optional\n"
        "    Attention sinks (gpt-oss): one logit per query head that joins every row's softmax\n"
        "    denominator with no value, ``p_ij = exp(s_ij) / (exp(sink) + sum_j exp(s_ij))``.\n"
        '    The backward returns its gradient as ``"sinks"``.\n'
        "return_lse : bool\n"
        "    Also return the log-sum-exp of each row's final logits (sinks included),\n"
        "    ``(..., h, n_q)``, natural log, ``-inf`` for a row with no key and no sink; last\n"
        "    in the returned tuple. :func:`attnlab.merge_attention` combines the results of\n"
        "    disjoint key sets with it."
    ),
    # what the reference's query/key/value and pooled families return
    "reference_attention_returns": (
        "Returns\n"
        "-------\n"
        "out : ndarray, shape (..., n_q, d_out)\n"
        "    float64.\n"
        "weights : ndarray, shape (..., h, n_q, n_k) or (..., n_q, n_k)\n"
        '    Only with ``return_weights`` (``"mean"`` averages over heads).'
    ),
    "reference_pooled_returns": "Returns\n-------\nndarray, shape (..., n, d_out)\n    float64.",
    # the opening of most examples of attnlab's functions
    "examples": (
        "Examples\n--------\n>>> import numpy as np, attnlab\n>>> rng = np.random.default_rng(0)"
    ),
    # the opening of every example of attnlab.reference
    "reference_examples": (
        "Examples\n"
        "--------\n"
        ">>> import numpy as np\n"
        ">>> from attnlab import reference\n"
        ">>> rng = np.random.default_rng(0)"
    ),
    # the opening of the examples of attnlab.interop's converters
    "interop_examples": "Examples\n--------\n>>> import numpy as np, attnlab",
    # the opening of every example of attnlab.torch
    "torch_examples": "Examples\n--------\n>>> import torch, attnlab.torch as at",
    # the opening of the examples of attnlab.init's initialisers
    "init_examples": "Examples\n--------\n>>> import numpy as np\n>>> from attnlab import init",
    # attnlab.dask: the mask, the two options of its own and the opening of its examples
    "dask_mask": (
        "mask : dask array or array_like of bool or float, optional\n"
        "    Broadcasts to ``(..., h, n_q, n_k)``, chunked with the queries and keys."
    ),
    "dask_options": (
        "return_lse : bool\n"
        "    Also return the log-sum-exp ``(..., h, n_q)`` (a dask array).\n"
        "split_every : int\n"
        "    How many partial results of key blocks one merge task combines (>= 2)."
    ),
    "dask_examples": (
        "Examples\n"
        "--------\n"
        ">>> import numpy as np, dask.array as da, attnlab, attnlab.dask\n"
        ">>> rng = np.random.default_rng(0)"
    ),
    # what the torch adapter's query/key/value families return
    "torch_attention_returns": (
        "Returns\n"
        "-------\n"
        "out : torch.Tensor, shape (..., n_q, d_out)\n"
        "    Differentiable with respect to every tensor argument but a boolean ``mask`` and\n"
        "    ``key_padding_mask`` (a float ``mask`` is when it requires grad).\n"
        "weights : torch.Tensor, optional\n"
        "    When ``return_weights`` is set; not differentiable."
    ),
    # what the torch adapter's pooled families return
    "torch_pooled_returns": (
        "Returns\n"
        "-------\n"
        "out : torch.Tensor, shape (..., n, d_out)\n"
        "    Differentiable with respect to every tensor argument but the mask."
    ),
}


def fill(doc: str, own: Mapping[str, str] | None = None) -> str:
    """``doc`` with every line that is only ``{name}`` (a fragment's name) replaced by the
    fragment, each of its lines indented as that line was. ``own``: fragments of this
    docstring alone (a generated function's, built from its signature)."""
    fragments = FRAGMENTS if own is None else {**FRAGMENTS, **own}
    lines = []
    for line in doc.split("\n"):
        name = line.strip()
        if name.startswith("{") and name.endswith("}") and name[1:-1] in fragments:
            indent = line[: len(line) - len(line.lstrip())]
            lines += [indent + part if part else part for part in fragments[name[1:-1]].split("\n")]
        else:
            lines.append(line)
    return "\n".join(lines)


def filled(f: F) -> F:
    """Decorator: ``f`` with its docstring's fragments filled in."""
    f.__doc__ = fill(f.__doc__ or "")
    return f
