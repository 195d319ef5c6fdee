"""A new user's first hour (issue 19): PyTorch habits get a warning or an error that names the
real cause, never a silent wrong answer.

- Boolean masks that leave query rows with no key (the sign of a mask in PyTorch's polarity)
  warn once per call with the count; ``warn_empty_rows=False`` silences it, in every family,
  its backward, the layers, the torch adapter and the reference.
- ``from_torch_mha`` warns for a sequence-first module.
- Errors name the root cause: the input's own shape, then the head counts against the
  weights' widths, then each weight against the input (the odd one out), with a hint for
  weights given as PyTorch stores them.
- Every docstring that takes masks says what the polarity and ``causal`` mean.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab import interop, layers, reference

POLARITY = (
    'In attnlab a boolean True means "may attend" (as in torch\'s scaled_dot_product_attention); '
    "nn.MultiheadAttention's masks use the opposite (True = masked out): convert them with "
    "attnlab.interop.torch_masks. If these rows are meant to be empty, pass "
    "warn_empty_rows=False."
)
ROWS = (
    "{} of {} query rows (counted over batch and heads) have no key they may attend to: the "
    "boolean masks (mask, key_padding_mask, with causal) leave none, so their attention "
    "weights are all 0. " + POLARITY
)
SEQS = (
    "{} of {} sequences have no token that key_padding_mask marks as real (True), so nothing "
    "is pooled for them. " + POLARITY
)
HINT = (
    "PyTorch's nn.Linear.weight is (out, in): pass weight.T, or use attnlab.interop.from_torch_mha"
)

B, N, D, H = 2, 5, 16, 4


def _w(rng: np.random.Generator, bias: bool = True) -> dict[str, np.ndarray]:
    w = {k: rng.standard_normal((D, D)) * 0.2 for k in ("w_q", "w_k", "w_v", "w_o")}
    if bias:
        w.update({k: rng.standard_normal(D) * 0.2 for k in ("b_q", "b_k", "b_v", "b_o")})
    return w


def _one_warning(fn: Callable[[], Any]) -> tuple[Any, str]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    mine = [r for r in rec if "warn_empty_rows=False" in str(r.message)]
    assert len(mine) == 1, [str(r.message) for r in rec]
    assert mine[0].category is UserWarning
    assert mine[0].filename == __file__, mine[0].filename  # attributed to the caller's line
    return out, str(mine[0].message)


def _no_warning(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


# ------------------------------------------------------------------ the PyTorch-polarity masks


def test_all_false_padding_mask_warns_with_the_count(rng):
    """PyTorch's "no padding" (all False) means "no real token" in attnlab: every row is b_o."""
    w, x = _w(rng), rng.standard_normal((B, N, D))
    kp = np.zeros((B, N), bool)
    out, msg = _one_warning(
        lambda: attnlab.multi_head_attention(x, **w, num_heads=H, key_padding_mask=kp)
    )
    assert msg == ROWS.format(B * H * N, B * H * N)
    np.testing.assert_array_equal(out, np.broadcast_to(w["b_o"], out.shape))  # contract kept
    fixed = interop.torch_masks(key_padding_mask=kp)["key_padding_mask"]
    _no_warning(lambda: attnlab.multi_head_attention(x, **w, num_heads=H, key_padding_mask=fixed))


def test_torch_polarity_causal_mask_warns_and_torch_masks_fixes_it(rng):
    """``triu(ones, 1)`` is PyTorch's causal mask (True = blocked); read as attnlab's, the last
    query row may attend to nothing."""
    w, x = _w(rng), rng.standard_normal((B, N, D))
    torch_causal = np.triu(np.ones((N, N), bool), 1)
    _, msg = _one_warning(
        lambda: attnlab.multi_head_attention(x, **w, num_heads=H, mask=torch_causal)
    )
    assert msg == ROWS.format(B * H, B * H * N)
    converted = interop.torch_masks(attn_mask=torch_causal)["mask"]
    got = _no_warning(lambda: attnlab.multi_head_attention(x, **w, num_heads=H, mask=converted))
    np.testing.assert_allclose(
        got, attnlab.multi_head_attention(x, **w, num_heads=H, causal=True), atol=1e-14
    )


def test_no_warning_without_empty_rows_or_for_causal_alone(rng):
    w, x, y = _w(rng), rng.standard_normal((B, N, D)), rng.standard_normal((B, 3, D))
    run = lambda **kw: _no_warning(lambda: attnlab.multi_head_attention(x, **w, num_heads=H, **kw))  # noqa: E731
    run()
    run(mask=np.ones((N, N), bool), causal=True)
    run(mask=np.full((N, N), -np.inf))  # a float mask is the same in both libraries
    run(key_padding_mask=np.eye(B, N, dtype=bool))
    # bottom-right with more queries than keys: the first rows see no key by causal alone
    _no_warning(
        lambda: attnlab.multi_head_attention(
            x, y, **w, num_heads=H, causal="bottom_right", key_padding_mask=np.ones((B, 3), bool)
        )
    )


def test_the_keyword_silences_it_and_is_checked(rng):
    w, x = _w(rng), rng.standard_normal((B, N, D))
    kp = np.zeros((B, N), bool)
    _no_warning(
        lambda: attnlab.multi_head_attention(
            x, **w, num_heads=H, key_padding_mask=kp, warn_empty_rows=False
        )
    )
    with pytest.raises(TypeError, match=r"^warn_empty_rows: expected True or False, got int 0$"):
        attnlab.multi_head_attention(x, **w, num_heads=H, key_padding_mask=kp, warn_empty_rows=0)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("n_q, n_k", [(5, 5), (7, 4), (3, 9), (130, 70)])
def test_count_agrees_with_the_reference(rng, causal, n_q, n_k):
    """The kernels' wrapper counts on the masks' own (broadcast) data in row blocks; the
    reference counts on the full boolean array. Both say the same number."""
    w = _w(rng)
    x, y = rng.standard_normal((B, n_q, D)), rng.standard_normal((B, n_k, D))
    warned = 0
    for mask in (
        rng.random((B, H, n_q, n_k)) < 0.15,
        rng.random((n_q, 1)) < 0.5,
        rng.random((1, n_k)) < 0.2,
        None,
    ):
        kp = rng.random((B, n_k)) < 0.6
        kw = dict(**w, num_heads=H, mask=mask, key_padding_mask=kp, causal=causal)
        msgs = []
        for f in (attnlab.multi_head_attention, reference.multi_head_attention):
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                f(x, y, **kw)
            msgs.append([str(r.message) for r in rec])
        assert msgs[0] == msgs[1]
        warned += bool(msgs[0])
    assert warned  # sparse masks: some rows are empty, so the comparison is not vacuous


def _families(rng: np.random.Generator) -> list[tuple[str, Callable[..., Any], dict[str, Any]]]:
    """(name, f(**extra), a call whose boolean masks leave rows empty)."""
    w, x = _w(rng), rng.standard_normal((B, N, D))
    kp = np.zeros((B, N), bool)
    kp[0] = True  # batch element 1 has no real token
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], w["b_q"], num_heads=H)
    bil = dict(w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], num_heads=H, key_padding_mask=kp)
    add = dict(
        w_q=w["w_q"],
        w_k=w["w_k"],
        w_g=np.ones(D),
        w_proj=w["w_v"],
        w_final=w["w_o"],
        key_padding_mask=kp,
    )
    sep = dict(w_qkv=rng.standard_normal((D, 1 + 2 * D)) * 0.2, w_o=w["w_o"], key_padding_mask=kp)
    mha = dict(**w, num_heads=H, key_padding_mask=kp)
    q4 = rng.standard_normal((B, H, N, 8))
    sdpa_mask = np.triu(np.ones((N, N), bool), 1)
    g = np.ones((B, N, D))
    out = [
        ("sdpa", lambda **e: attnlab.scaled_dot_product_attention(q4, q4, q4, mask=sdpa_mask, **e)),
        (
            "sdpa_backward",
            lambda **e: attnlab.scaled_dot_product_attention_backward(
                np.ones_like(q4), q4, q4, q4, mask=sdpa_mask, **e
            ),
        ),
        (
            "sdpa_reference",
            lambda **e: reference.scaled_dot_product_attention(q4, q4, q4, mask=sdpa_mask, **e),
        ),
        ("mha", lambda **e: attnlab.multi_head_attention(x, **mha, **e)),
        ("mha_backward", lambda **e: attnlab.multi_head_attention_backward(g, x, **mha, **e)),
        ("mha_reference", lambda **e: reference.multi_head_attention(x, **mha, **e)),
        ("bilinear", lambda **e: attnlab.bilinear_attention(x, **bil, **e)),
        ("bilinear_backward", lambda **e: attnlab.bilinear_attention_backward(g, x, **bil, **e)),
        ("bilinear_reference", lambda **e: reference.bilinear_attention(x, **bil, **e)),
        ("additive", lambda **e: attnlab.additive_attention(x, **add, **e)),
        ("additive_backward", lambda **e: attnlab.additive_attention_backward(g, x, **add, **e)),
        ("additive_reference", lambda **e: reference.additive_attention(x, **add, **e)),
        ("separable", lambda **e: attnlab.separable_attention(x, **sep, **e)),
        ("separable_backward", lambda **e: attnlab.separable_attention_backward(g, x, **sep, **e)),
        ("separable_reference", lambda **e: reference.separable_attention(x, **sep, **e)),
    ]
    for name, layer in (
        ("MultiHeadAttention", layers.MultiHeadAttention(D, H, seed=0)),
        ("BilinearAttention", layers.BilinearAttention(D, H, seed=0)),
        ("AdditiveAttention", layers.AdditiveAttention(D, seed=0)),
        ("SeparableAttention", layers.SeparableAttention(D, seed=0)),
    ):

        def fwd_bwd(layer: Any = layer, **e: Any) -> Any:
            y = layer(x, key_padding_mask=kp, **e)
            return layer.backward(np.ones_like(y))  # the backward does not warn again

        out.append((f"layers.{name}", fwd_bwd))
    return out


FAMILIES = [name for name, _ in _families(np.random.default_rng(0))]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_warns_once_and_the_keyword_silences_it(rng, name):
    fn = dict(_families(rng))[name]
    _, msg = _one_warning(fn)
    pooled = name.split("_")[0] in ("additive", "separable") or name in (
        "layers.AdditiveAttention",
        "layers.SeparableAttention",
    )
    if pooled:
        assert msg == SEQS.format(1, B)
    elif name.startswith("sdpa"):
        assert msg == ROWS.format(B * H, B * H * N)
    else:
        assert msg == ROWS.format(H * N, B * H * N)
    _no_warning(lambda: fn(warn_empty_rows=False))


@pytest.mark.parametrize(
    "name",
    [
        "scaled_dot_product_attention",
        "multi_head_attention",
        "bilinear_attention",
        "additive_attention",
        "separable_attention",
    ],
)
def test_torch_adapter_warns_once_for_forward_and_backward(rng, name):
    torch = pytest.importorskip("torch")
    import attnlab.torch as at

    w, x = _w(rng), torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    kp = torch.zeros(B, N, dtype=torch.bool)
    kp[0] = True
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    calls = {
        "scaled_dot_product_attention": lambda **e: at.scaled_dot_product_attention(
            x.view(B, N, H, 4).transpose(1, 2),
            x.view(B, N, H, 4).transpose(1, 2),
            x.view(B, N, H, 4).transpose(1, 2),
            mask=torch.triu(torch.ones(N, N, dtype=bool), 1),
            **e,
        ),
        "multi_head_attention": lambda **e: at.multi_head_attention(
            x, **t, num_heads=H, key_padding_mask=kp, **e
        ),
        "bilinear_attention": lambda **e: at.bilinear_attention(
            x,
            w_qk=torch.randn(H, D, D, dtype=torch.float64),
            w_v=t["w_v"],
            w_o=t["w_o"],
            num_heads=H,
            key_padding_mask=kp,
            **e,
        ),
        "additive_attention": lambda **e: at.additive_attention(
            x,
            w_q=t["w_q"],
            w_k=t["w_k"],
            w_g=torch.ones(D, dtype=torch.float64),
            w_proj=t["w_v"],
            w_final=t["w_o"],
            key_padding_mask=kp,
            **e,
        ),
        "separable_attention": lambda **e: at.separable_attention(
            x,
            w_qkv=torch.randn(D, 1 + 2 * D, dtype=torch.float64),
            w_o=t["w_o"],
            key_padding_mask=kp,
            **e,
        ),
    }
    call = calls[name]
    _one_warning(lambda: call().sum().backward())
    _no_warning(lambda: call(warn_empty_rows=False).sum().backward())


# ------------------------------------------------------------------ from_torch_mha, seq-first


def test_from_torch_mha_warns_for_a_sequence_first_module():
    torch = pytest.importorskip("torch")
    seq_first = torch.nn.MultiheadAttention(D, H)  # batch_first=False, PyTorch's default
    with pytest.warns(UserWarning, match="sequence-first") as rec:
        kw = interop.from_torch_mha(seq_first)
    assert len(rec) == 1 and rec[0].filename == __file__
    assert str(rec[0].message) == (
        "from_torch_mha: the module is sequence-first (batch_first=False, PyTorch's default) and "
        "takes (n, B, d) inputs; attnlab's are batch-first (B, n, d): swap the first two axes, "
        "x.transpose(1, 0, 2) (NumPy) or x.transpose(0, 1) (torch), and the output's back"
    )
    # and the advice is right: swapped in, swapped back, the outputs agree
    x = torch.randn(N, B, D)
    with torch.no_grad():
        ref = seq_first.eval()(x, x, x, need_weights=False)[0].numpy()
    got = attnlab.multi_head_attention(x.numpy().transpose(1, 0, 2), **kw).transpose(1, 0, 2)
    np.testing.assert_allclose(got, ref, atol=2e-6)
    _no_warning(lambda: interop.from_torch_mha(torch.nn.MultiheadAttention(D, H, batch_first=True)))


# ------------------------------------------------------------------ errors name the root cause


def _raises(fn: Callable[[], Any], message: str, exc: type = ValueError) -> None:
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value) == message


def test_heads_that_do_not_divide_are_named(rng):
    w, x = _w(rng, bias=False), rng.standard_normal((B, N, D))
    _raises(
        lambda: attnlab.multi_head_attention(x, **w, num_heads=3),
        "num_heads: 3 does not divide the 16 columns of w_q (16, 16), which is "
        "(d_q, num_heads * d_head)",
    )
    w8 = dict(w, w_k=w["w_k"][:, :12], w_v=w["w_v"][:, :12])  # 12 = h_kv * d_head?
    _raises(
        lambda: attnlab.multi_head_attention(x, **w8, num_heads=8, num_kv_heads=8),
        "num_kv_heads: 8 does not divide the 12 columns of w_k (16, 12), which is "
        "(d_k, num_kv_heads * d_head)",
    )


def test_an_input_of_the_wrong_width_is_named(rng):
    w = _w(rng)
    _raises(
        lambda: attnlab.multi_head_attention(rng.standard_normal((B, N, 12)), **w, num_heads=H),
        "query: expected last dimension 16, as read by w_q (16, 16), w_k (16, 16), "
        "w_v (16, 16), got shape (2, 5, 12)",
    )
    _raises(
        lambda: attnlab.multi_head_attention(
            rng.standard_normal((B, N, D)), rng.standard_normal((B, 6, 12)), **w, num_heads=H
        ),
        "key: expected last dimension 16, as read by w_k (16, 16), w_v (16, 16), got shape "
        "(2, 6, 12)",
    )


def test_a_bad_weight_is_named_not_its_neighbour(rng):
    w, x = _w(rng), rng.standard_normal((B, N, D))
    _raises(
        lambda: attnlab.multi_head_attention(
            x, **dict(w, w_q=w["w_q"][:, :12], b_q=w["b_q"][:12]), num_heads=H
        ),
        "w_q: expected shape (d_q, num_heads * d_head) = (16, 16) with d_head = 4 as in w_k "
        "(16, 16), got (16, 12) (d_head = 3)",
    )
    _raises(
        lambda: attnlab.multi_head_attention(x, **dict(w, w_q=w["w_q"][:12, :12]), num_heads=H),
        "w_q: expected 16 rows (the features of query (2, 5, 16)) in shape "
        "(d_q, num_heads * d_head), got (12, 12)",
    )


@pytest.mark.parametrize("name", ["w_q", "w_k", "w_v"])
def test_a_torch_layout_weight_gets_the_transpose_hint(rng, name):
    """A non-square nn.Linear.weight passed as it is ((out, in)) instead of transposed."""
    d_in, d_out = 12, 16
    w = {k: rng.standard_normal((d_in, d_out)) for k in ("w_q", "w_k", "w_v")}
    w["w_o"] = rng.standard_normal((d_out, d_in))
    x = rng.standard_normal((B, N, d_in))
    attnlab.multi_head_attention(x, **w, num_heads=H)  # valid as (in, out)
    layout = {
        "w_q": "(d_q, num_heads * d_head)",
        "w_k": "(d_k, num_heads * d_head)",
        "w_v": "(d_v, num_heads * d_vhead)",
    }[name]
    bad = dict(w, **{name: w[name].T})
    _raises(
        lambda: attnlab.multi_head_attention(x, **bad, num_heads=H),
        f"{name}: expected shape {layout}, got (16, 12); {HINT}",
    )
    if name == "w_q":  # also when the head count does not divide the (wrong) width 12
        _raises(
            lambda: attnlab.multi_head_attention(x, **bad, num_heads=8),
            f"w_q: expected shape {layout}, got (16, 12); {HINT}",
        )


def test_other_families_name_the_root_cause(rng):
    x, xw = rng.standard_normal((B, N, D)), rng.standard_normal((B, N, 12))
    w = _w(rng, bias=False)
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], num_heads=H)
    _raises(
        lambda: attnlab.bilinear_attention(xw, w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], num_heads=H),
        "query: expected last dimension 16, as read by w_qk (4, 16, 16), w_qk (4, 16, 16), "
        "w_v (16, 16), got shape (2, 5, 12)",
    )
    _raises(
        lambda: attnlab.bilinear_attention(x, w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], num_heads=3),
        "num_heads: 3 does not match the 4 heads of w_qk (4, 16, 16), which is "
        "(num_heads, d_q, d_k)",
    )
    add = dict(w_q=w["w_q"], w_k=w["w_k"], w_g=np.ones(D), w_proj=w["w_v"], w_final=w["w_o"])
    _raises(
        lambda: attnlab.additive_attention(xw, **add),
        "x: expected last dimension 16, as read by w_q (16, 16), w_k (16, 16), got shape "
        "(2, 5, 12)",
    )
    narrow = dict(
        w_q=rng.standard_normal((D, 8)),
        w_k=rng.standard_normal((D, 8)),
        w_g=np.ones(8),
        w_proj=np.eye(8),
        w_final=rng.standard_normal((8, D)),
    )
    attnlab.additive_attention(x, **narrow)  # valid: D = 8
    _raises(
        lambda: attnlab.additive_attention(x, **dict(narrow, w_q=narrow["w_q"].T)),
        "w_q: expected shape (d_in, D) = (16, D), got (8, 16); PyTorch's nn.Linear.weight is "
        "(out, in): pass weight.T, or use attnlab.interop.from_swiftformer",
    )
    sep = dict(w_qkv=rng.standard_normal((D, 1 + 2 * D)), w_o=w["w_o"])
    _raises(
        lambda: attnlab.separable_attention(xw, **sep),
        "x: expected last dimension 16, as read by w_qkv (16, 33), got shape (2, 5, 12)",
    )
    _raises(
        lambda: attnlab.separable_attention(x, **dict(sep, w_qkv=sep["w_qkv"].T)),
        "w_qkv: expected shape (d, 1 + 2 d) = (16, 33), got (33, 16); PyTorch's "
        "nn.Linear.weight is (out, in): pass weight.T, or use "
        "attnlab.interop.from_mobilevitv2",
    )


@pytest.mark.parametrize(
    "layer, call, message",
    [
        (
            layers.MultiHeadAttention(16, 4, seed=0),
            lambda L, r: L(r((2, 5, 12))),
            (
                "query: expected last dimension d_model = 16 (this MultiHeadAttention's d_model), "
                "got shape "
                "(2, 5, 12)"
            ),
        ),
        (
            layers.MultiHeadAttention(16, 4, kdim=8, seed=0),
            lambda L, r: L(r((2, 5, 16)), r((2, 6, 9))),
            (
                "key: expected last dimension kdim = 8 (this MultiHeadAttention's kdim), got shape "
                "(2, 6, 9)"
            ),
        ),
        (
            layers.BilinearAttention(16, 4, seed=0),
            lambda L, r: L(r((5, 12))),
            (
                "query: expected last dimension d_model = 16 (this BilinearAttention's d_model), "
                "got shape "
                "(5, 12)"
            ),
        ),
        (
            layers.AdditiveAttention(16, seed=0),
            lambda L, r: L(r((2, 5, 12))),
            (
                "x: expected last dimension d_model = 16 (this AdditiveAttention's d_model), "
                "got shape "
                "(2, 5, 12)"
            ),
        ),
        (
            layers.SeparableAttention(16, seed=0),
            lambda L, r: L(r((2, 5, 12))),
            (
                "x: expected last dimension d_model = 16 (this SeparableAttention's d_model), "
                "got shape "
                "(2, 5, 12)"
            ),
        ),
    ],
)
def test_layers_name_their_own_attribute(rng, layer, call, message):
    _raises(lambda: call(layer, rng.standard_normal), message)


# ------------------------------------------------------------------ docstrings


def _mask_taking() -> list[tuple[str, Callable[..., Any]]]:
    fns: list[tuple[str, Callable[..., Any]]] = []
    for name in attnlab.__all__:
        obj = getattr(attnlab, name)
        if inspect.isfunction(obj) and {"mask", "key_padding_mask"} & set(
            inspect.signature(obj).parameters
        ):
            fns.append((f"attnlab.{name}", obj))
    fns += [
        ("layers._QKVLayer.__call__", layers._QKVLayer.__call__),
        ("layers.AdditiveAttention.__call__", layers.AdditiveAttention.__call__),
        ("layers.SeparableAttention.__call__", layers.SeparableAttention.__call__),
    ]
    try:
        import attnlab.torch as at
    except ImportError:
        return fns
    return fns + [(f"attnlab.torch.{n}", getattr(at, n)) for n in at.__all__]


MASKED = _mask_taking()


@pytest.mark.parametrize("name, fn", MASKED, ids=[n for n, _ in MASKED])
def test_docstrings_say_the_polarity_and_the_keyword(name, fn):
    doc = " ".join((inspect.getdoc(fn) or "").split())
    assert "warn_empty_rows" in inspect.signature(fn).parameters, name
    for words in ("nn.MultiheadAttention", "torch_masks", "warn_empty_rows"):
        assert words in doc, f"{name}: the docstring does not mention {words}"
    params = inspect.signature(fn).parameters
    if "causal" in params and "As for" not in doc.split("causal")[1][:200]:
        assert "j <= i" in doc and "bottom_right" in doc, f"{name}: causal modes not explained"


def _derived_docs() -> list[tuple[str, Callable[..., Any], Callable[..., Any]]]:
    """(name, forward, derived) for every function whose docstring lists a forward's
    parameters by generating the list (the backwards, the torch wrappers)."""
    forwards = [
        attnlab.scaled_dot_product_attention,
        attnlab.multi_head_attention,
        attnlab.bilinear_attention,
    ]
    out = [
        (f"attnlab.{f.__name__}_backward", f, getattr(attnlab, f"{f.__name__}_backward"))
        for f in forwards
    ]
    try:
        import attnlab.torch as at
    except ImportError:
        return out
    return out + [(f"attnlab.torch.{f.__name__}", f, getattr(at, f.__name__)) for f in forwards]


DERIVED_DOCS = _derived_docs()


@pytest.mark.parametrize("name, forward, fn", DERIVED_DOCS, ids=[n for n, _, _ in DERIVED_DOCS])
def test_derived_docstrings_name_every_parameter(name, forward, fn):
    """A new mask option (a parameter of the forwards) reaches the backwards' and the torch
    wrappers' Parameters sections without an edit there."""
    doc = inspect.getdoc(fn) or ""
    section = doc.split("Parameters\n----------\n")[1].split("\nReturns\n")[0]
    heads = [line.split(" : ")[0] for line in section.splitlines() if line[:1].isalpha()]
    names = {n.strip() for line in heads for n in line.split(",")}
    params = [p for p in inspect.signature(forward).parameters if not p.startswith("_")]
    missing = [p for p in params if p not in names and p != "return_weights"]
    assert not missing, f"{name}: the Parameters section does not name {missing}"
    assert "{" not in section, f"{name}: a fragment was not filled in"


@pytest.mark.parametrize(
    "fn",
    [
        attnlab.scaled_dot_product_attention,
        attnlab.multi_head_attention,
        attnlab.bilinear_attention,
        attnlab.additive_attention,
        attnlab.separable_attention,
    ],
)
def test_family_docstrings_state_the_dtype_rules(fn):
    doc = " ".join((inspect.getdoc(fn) or "").split())
    assert re.search(
        r"float32 and float64 are computed natively and the result keeps that "
        r"dtype; mixed inputs follow ``np.result_type``",
        doc,
    ), fn.__name__
    assert "raise ``TypeError``" in doc
