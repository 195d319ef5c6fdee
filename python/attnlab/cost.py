"""Parameters, multiply-adds and working memory of the query-key score stage, separate vs collapsed.

The two forms compute the same attention logits per head ``i``:

* ``"separate"``: ``(X_q W_q,i)(X_k W_k,i)^T``, two projections to ``d_head`` then a product
  over ``d_head``;
* ``"collapsed"``: ``X_q W_i X_k^T`` with the folded ``W_i = W_q,i W_k,i^T`` (``d x d``), in
  whichever order is cheaper: ``(X_q W_i) X_k^T`` (the *query* order) or ``X_q (W_i X_k^T)``
  (the *key* order).

Everything after the logits (softmax, ``P V``, value and output projections) is the same in both
forms and is not counted. :func:`plan_qk` picks the cheaper form; :func:`collapsed_order` is the
rule :func:`attnlab.bilinear_attention` uses to pick its evaluation order.
"""

from __future__ import annotations

from typing import Any

from . import _signature as _sig
from . import _validate as V

__all__ = [
    "attention_cost",
    "collapsed_order",
    "collapsed_order_flops",
    "latent_cost",
    "plan_latent",
    "plan_qk",
]

_FORMS = ("separate", "collapsed")


def collapsed_order_flops(
    *,
    n_q: int,
    n_k: int,
    d_q: int,
    d_k: int,
    num_heads: int,
    batch: int = 1,
    key_bias: bool = False,
) -> dict[str, int]:
    """Multiply-adds of the two evaluation orders of the collapsed logits.

    ``{"query": batch*h*(n_q*d_q*d_k + n_q*n_k*d_k), "key": batch*h*(n_k*d_k*d_q +
    n_q*n_k*(d_q + key_bias))}``; in the key order a key-side bias ``u`` rides along as one
    extra column (the query order adds it to ``X_q W_i`` for free).
    """
    e = 1 if key_bias else 0
    a = batch * num_heads * (n_q * d_q * d_k + n_q * n_k * d_k)
    b = batch * num_heads * (n_k * d_k * d_q + n_q * n_k * (d_q + e))
    return {"query": int(a), "key": int(b)}


def collapsed_order(
    *,
    n_q: int,
    n_k: int,
    d_q: int,
    d_k: int,
    num_heads: int,
    batch: int = 1,
    key_bias: bool = False,
) -> str:
    """``"query"`` or ``"key"``: the cheaper order by :func:`collapsed_order_flops`.

    Ties go to ``"query"``, which needs no extra copies (self-attention without ``u`` is a tie).
    """
    f = collapsed_order_flops(
        n_q=n_q, n_k=n_k, d_q=d_q, d_k=d_k, num_heads=num_heads, batch=batch, key_bias=key_bias
    )
    return "key" if f["key"] < f["query"] else "query"


def _sizes(
    n_q: Any, n_k: Any, d_model: Any, num_heads: Any, d_head: Any, batch: Any, num_kv_heads: Any
) -> tuple[int, int, int, int, int, int, int]:
    nq = V.check_positive_int(n_q, "n_q", 0)
    nk = nq if n_k is None else V.check_positive_int(n_k, "n_k", 0)
    d = V.check_positive_int(d_model, "d_model")
    h = V.check_positive_int(num_heads, "num_heads")
    if d_head is None:
        if d % h:
            raise ValueError(
                f"d_head: d_model ({d}) is not a multiple of num_heads ({h}); give d_head"
            )
        dh = d // h
    else:
        dh = V.check_positive_int(d_head, "d_head")
    b = V.check_positive_int(batch, "batch", 0)
    hk = h if num_kv_heads is None else V.check_positive_int(num_kv_heads, "num_kv_heads")
    if h % hk:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {h}, got {hk}")
    return nq, nk, d, h, dh, b, hk


def attention_cost(
    form: str,
    *,
    n_q: int,
    n_k: int | None = None,
    d_model: int,
    num_heads: int,
    d_head: int | None = None,
    batch: int = 1,
    num_kv_heads: int | None = None,
    cached: bool = False,
    itemsize: int = 8,
) -> dict[str, int]:
    """Cost of the query-key logits of one attention layer, in the separate or collapsed form.

    Parameters
    ----------
    form : {"separate", "collapsed"}
    n_q : int
        Query tokens (1 for one-token decode).
    n_k : int, optional
        Key tokens; defaults to ``n_q`` (self-attention). Cross-attention: any ``n_k``.
    d_model : int
        ``d``, the width of the query and key inputs (``d_q = d_k = d``).
    num_heads : int
        ``h``.
    d_head : int, optional
        Defaults to ``d_model // num_heads``.
    batch : int
    num_kv_heads : int, optional
        ``h_kv`` (grouped-query keys), defaults to ``h``.
    cached : bool
        Decode against ``n_k`` cached keys: the keys come ready from a cache (projected keys for
        ``"separate"``, the raw ``x_k`` for ``"collapsed"``, whose cache holds ``d`` numbers per
        token shared by every head), so no key projection is counted and the collapsed form
        must use the query order.
    itemsize : int
        Bytes per number (8 for float64, 4 for float32).

    Returns
    -------
    dict
        ``"params"``: weight numbers (biases not counted); ``"flops"``: multiply-adds (one
        multiply-add = 2 floating-point operations); ``"bytes"``: the two operands of the score
        products, the query-side and key-side arrays the attention core streams through (its own
        tiles are O(n d), never n_q x n_k).

    Notes
    -----
    With ``h`` heads, ``h_kv`` key heads, ``d_h = d_head`` and ``B = batch``:

    ``"separate"``::

        params = d*h*d_h + d*h_kv*d_h
        flops  = B * (n_q*d*h*d_h                  # Q = X_q W_q
                      + n_k*d*h_kv*d_h             # K = X_k W_k   (0 when cached)
                      + h*n_q*n_k*d_h)             # Q_i K_i^T
        bytes  = B * (n_q*h*d_h + n_k*h_kv*d_h) * itemsize

    ``"collapsed"`` (``W_i`` is ``d x d`` for every query head, GQA or not)::

        params = h*d*d
        flops  = B*h * min(n_q*d*d + n_q*n_k*d,    # query order: (X_q W_i) X_k^T
                           n_k*d*d + n_q*n_k*d)    # key order:   X_q (W_i X_k^T), not cached
        bytes  = B * (n_q*h*d + n_k*d) * itemsize  # query order (X_q W_i, X_k)
               | B * (n_q*d + n_k*h*d) * itemsize  # key order (X_q, X_k W_i^T)

    So per head, for self-attention over ``n`` tokens: separate ``2*n*d*d_h + n^2*d_h``,
    collapsed ``n*d^2 + n^2*d`` multiply-adds; parameters ``2*d*d_h`` against ``d^2``.
    Collapsing pays off when ``d_h`` is large against ``d`` (``h = 1``, or ``d_h > d/2`` at
    short lengths: collapsed is cheaper iff ``d_h (2d + n) > d (d + n)``), or for decode with a
    narrow cache; with the usual ``d_h = d/h`` and ``h >= 2`` it costs more, up to ``h`` times.
    The key-side bias ``u`` of a collapsed form costs one more column in the key order; none of
    this holds with rotary position embeddings, whose rotation sits between ``W_q`` and ``W_k``.

    Examples
    --------
    >>> from attnlab import attention_cost
    >>> attention_cost("separate", n_q=128, d_model=64, num_heads=1)
    {'params': 8192, 'flops': 2097152, 'bytes': 131072}
    >>> attention_cost("collapsed", n_q=128, d_model=64, num_heads=1)["flops"]
    1572864
    """
    if form not in _FORMS:
        raise ValueError(f"form: expected 'separate' or 'collapsed', got {form!r}")
    nq, nk, d, h, dh, b, hk = _sizes(n_q, n_k, d_model, num_heads, d_head, batch, num_kv_heads)
    it = V.check_positive_int(itemsize, "itemsize")
    if form == "separate":
        params = d * h * dh + d * hk * dh
        flops = b * (nq * d * h * dh + (0 if cached else nk * d * hk * dh) + h * nq * nk * dh)
        nbytes = b * (nq * h * dh + nk * hk * dh) * it
    else:
        params = h * d * d
        f = collapsed_order_flops(n_q=nq, n_k=nk, d_q=d, d_k=d, num_heads=h, batch=b)
        if cached or f["query"] <= f["key"]:
            flops = f["query"]
            nbytes = b * (nq * h * d + nk * d) * it
        else:
            flops = f["key"]
            nbytes = b * (nq * d + nk * h * d) * it
    return {"params": int(params), "flops": int(flops), "bytes": int(nbytes)}


def plan_qk(
    *,
    n_q: int,
    n_k: int | None = None,
    d_model: int,
    num_heads: int,
    d_head: int | None = None,
    batch: int = 1,
    num_kv_heads: int | None = None,
    cached: bool = False,
) -> str:
    """``"separate"`` or ``"collapsed"``: the form with fewer multiply-adds by
    :func:`attention_cost` (ties go to ``"separate"``, which has fewer parameters).

    Parameters
    ----------
    n_q, n_k, d_model, num_heads, d_head, batch, num_kv_heads, cached
        As for :func:`attention_cost`.

    Returns
    -------
    str
        ``"separate"`` or ``"collapsed"``.

    Examples
    --------
    >>> from attnlab import plan_qk
    >>> plan_qk(n_q=197, d_model=384, num_heads=6), plan_qk(n_q=197, d_model=384, num_heads=1)
    ('separate', 'collapsed')
    """
    kw = _sig.arguments(locals())  # every argument, passed on as given
    sep = attention_cost("separate", **kw)["flops"]
    col = attention_cost("collapsed", **kw)["flops"]
    return "collapsed" if col < sep else "separate"


# -- multi-head latent attention (DeepSeek's MLA) ---------------------------------------------

_LATENT_FORMS = ("expanded", "absorbed")


def _latent_core_macs(
    form: str, B: int, n_q: int, n_k: int, h: int, r: int, dn: int, dr: int, dv: int
) -> int:
    """Multiply-adds of the part of latent attention where the two forms differ: from the
    latents ``(n_k, r)`` and the queries to the heads' contexts ``(n_q, h, d_v)``."""
    if form == "expanded":  # every key up-projected, then attention with d_nope + d_rope, d_v
        return B * (n_k * r * h * (dn + dv) + h * n_q * n_k * (dn + dr + dv))
    # W_uk into each query, W_uv after; attention over the latents: r + d_rope, then r
    return B * (n_q * h * r * (dn + dv) + h * n_q * n_k * (2 * r + dr))


def latent_cost(
    form: str,
    *,
    n_q: int,
    n_k: int | None = None,
    d_model: int,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None = None,
    batch: int = 1,
    itemsize: int = 4,
) -> dict[str, int]:
    """Cost of one multi-head latent attention layer (:func:`attnlab.latent_attention`) in
    the expanded or the absorbed form.

    Parameters
    ----------
    form : {"expanded", "absorbed"}
    n_q : int
        New tokens (queries): the prompt for prefill, 1 for a decode step.
    n_k : int, optional
        Keys: cached tokens plus the new ones; defaults to ``n_q`` (no cache).
    d_model, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        ``d``, ``h``, ``r``, ``d_nope``, ``d_rope``, ``d_v`` (transformers' config names).
    q_lora_rank : int, optional
        The query latent's width (``None``: one query projection).
    batch : int
    itemsize : int
        Bytes per number (4 for float32).

    Returns
    -------
    dict
        ``"params"`` (weight numbers, norms and biases not counted); ``"flops"``, multiply-adds
        of the whole layer (the projections both forms share included); ``"attention_flops"``,
        those of them the attention core makes (scores and weighted values: ``B*h*n_q*n_k``
        times ``d_nope+d_rope+d_v`` expanded, ``2r+d_rope`` absorbed; the rest are GEMMs);
        ``"bytes"``, the
        memory traffic of the passes :func:`attnlab.latent_attention` makes: the weights read
        once, the cached latents read and every latent written (the new cache), the queries
        and contexts; expanded: the latents' ``c`` copied and read by the up-projection, the
        keys and values written, the keys' no-rope part read back, both read by attention;
        absorbed: the absorbed queries and contexts, the latents read by attention once for
        one query token (every head is a row of the one key head), once per head for more
        (the attention core's tiles are O(n d) and not counted); and
        ``"cache_bytes_per_token"``, the cache of one token: ``(r + d_rope) * itemsize``,
        against ``2 * h * d_head * itemsize`` for multi-head attention of head width
        ``d_head``.

    Notes
    -----
    With ``B = batch``, shared by both forms (queries, latent, output)::

        B * n_q * (d*h*(d_nope+d_rope) [or d*q_lora + q_lora*h*(d_nope+d_rope)]
                   + d*(r+d_rope) + h*d_v*d)

    ``"expanded"``: ``B * (n_k*r*h*(d_nope+d_v) + h*n_q*n_k*(d_nope+d_rope+d_v))``;
    ``"absorbed"``: ``B * (n_q*h*r*(d_nope+d_v) + h*n_q*n_k*(2r+d_rope))``. A decode step
    (``n_q = 1``) against ``n_k`` cached tokens costs about ``r*(d_nope+d_v) / (2r+d_rope)``
    times less absorbed (120x with DeepSeek-V3's sizes, before the projections both share);
    prefill (``n_q = n_k``) about ``(2r+d_rope) / (d_nope+d_rope+d_v)`` times more (3.4x).

    Bytes, in numbers of ``itemsize`` each, with ``L = r + d_rope``::

        params + B * ((2*n_k - n_q)*L + 2*n_q*h*(d_nope+d_rope+d_v)
                      + 3*n_k*r + n_k*d_rope + n_k*h*(4*d_nope+2*d_rope+2*d_v)  # expanded
                      + 2*n_q*h*(L+r) + (1 if n_q == 1 else h)*n_k*L)             # absorbed

    A decode step reads every weight once and the cache about twice in either form; the
    expanded form also writes and reads ``h`` heads' keys and values per cached token. At batch
    1 the absorbed step is bound by these bytes, the expanded one by its up-projection's
    multiply-adds: ``python -m attnlab bench`` (family ``latent``) turns both into times with
    this machine's measured GEMM rate and memory bandwidth.

    Examples
    --------
    >>> from attnlab.cost import latent_cost
    >>> kw = dict(d_model=1024, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
    ...           qk_rope_head_dim=64, v_head_dim=128)
    >>> e = latent_cost("expanded", n_q=1, n_k=4096, **kw)["flops"]
    >>> a = latent_cost("absorbed", n_q=1, n_k=4096, **kw)["flops"]
    >>> round(e / a)
    109
    """
    if form not in _LATENT_FORMS:
        raise ValueError(f"form: expected 'expanded' or 'absorbed', got {form!r}")
    nq = V.check_positive_int(n_q, "n_q", 0)
    nk = nq if n_k is None else V.check_positive_int(n_k, "n_k", 0)
    if nk < nq:
        raise ValueError(f"n_k: expected the keys to include the {nq} new tokens, got {nk}")
    d = V.check_positive_int(d_model, "d_model")
    h = V.check_positive_int(num_heads, "num_heads")
    r = V.check_positive_int(kv_lora_rank, "kv_lora_rank")
    dn = V.check_positive_int(qk_nope_head_dim, "qk_nope_head_dim")
    dr = V.check_positive_int(qk_rope_head_dim, "qk_rope_head_dim")
    dv = V.check_positive_int(v_head_dim, "v_head_dim")
    qr = None if q_lora_rank is None else V.check_positive_int(q_lora_rank, "q_lora_rank")
    b = V.check_positive_int(batch, "batch", 0)
    it = V.check_positive_int(itemsize, "itemsize")
    q_params = d * h * (dn + dr) if qr is None else d * qr + qr * h * (dn + dr)
    params = q_params + d * (r + dr) + r * h * (dn + dv) + h * dv * d
    shared = b * nq * (q_params + d * (r + dr) + h * dv * d)
    flops = shared + _latent_core_macs(form, b, nq, nk, h, r, dn, dr, dv)
    # memory traffic, the passes latent_attention makes: the weights once; the cached latents
    # read and all the latents written (the new cache); the queries and contexts written, read
    lat = r + dr
    act = (2 * nk - nq) * lat + 2 * nq * h * (dn + dr + dv)
    if form == "expanded":
        # c copied out of the latents and read by the up-projection, the rotary key read; keys
        # and values written, the keys' no-rope part read from them, both read by attention
        act += 3 * nk * r + nk * dr + nk * h * (4 * dn + 2 * dr + 2 * dv)
    else:
        # absorbed queries and their contexts written and read; attention reads the latents
        # once for one query (its heads are the rows of one key head), once per head for more
        act += 2 * nq * h * (lat + r) + (1 if nq == 1 else h) * nk * lat
    nbytes = (params + b * act) * it
    width = dn + dr + dv if form == "expanded" else 2 * r + dr  # scores and values per pair
    return {
        "params": int(params),
        "flops": int(flops),
        "attention_flops": int(b * h * nq * nk * width),
        "bytes": int(nbytes),
        "cache_bytes_per_token": int((r + dr) * it),
    }


def plan_latent(
    *,
    n_q: int,
    n_k: int | None = None,
    d_model: int,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None = None,
    batch: int = 1,
) -> str:
    """``"expanded"`` or ``"absorbed"``: the form of :func:`attnlab.latent_attention` with
    fewer multiply-adds by :func:`latent_cost` (ties go to ``"expanded"``);
    ``form="auto"`` uses this rule.

    Parameters
    ----------
    n_q, n_k, d_model, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim
    v_head_dim, q_lora_rank, batch
        As for :func:`latent_cost`.

    Returns
    -------
    str

    Examples
    --------
    >>> from attnlab.cost import plan_latent
    >>> kw = dict(d_model=1024, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
    ...           qk_rope_head_dim=64, v_head_dim=128)
    >>> plan_latent(n_q=1, n_k=4096, **kw), plan_latent(n_q=4096, **kw)
    ('absorbed', 'expanded')
    """
    kw = _sig.arguments(locals())
    e = latent_cost("expanded", **kw)["flops"]
    a = latent_cost("absorbed", **kw)["flops"]
    return "absorbed" if a < e else "expanded"
