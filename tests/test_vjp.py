"""attnlab.vjp: one forward, then gradients from what it kept.

For every family: the output is bitwise the forward's, the pullback equals the family's
``*_backward`` (bitwise: the kept state is what the backward would recompute), calling it twice
gives the same, and changing the caller's arrays in place after the forward does not change
it. (With ``return_weights`` the forward runs the dense path: equal to rounding.) For the
families that keep state, the pullback reads that state and runs no forward."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
import fuzz_stress as F
from test_backward_additive import additive_args

FAMILIES = list(F.FORWARD_BUILDERS)
# random cases may mask every key of a row (the forward warns; the pullback must not warn again)
pytestmark = pytest.mark.empty_rows


def _case(family: str, seed: int, dtype: type) -> F.Case:
    return F.build(F.Chooser(np.random.default_rng(seed)), family, dtype)


def _same_grads(got: dict, want: dict, case: F.Case) -> None:
    """Bitwise, except that with the weights asked for the forward ran the dense path, whose
    intermediates the pullback differentiates, while *_backward recomputes the flash path:
    then equal to rounding."""
    dense = bool(case.kwargs.get("return_weights"))
    dtype = np.dtype(case.dtype)
    floor = F.grad_scale(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        if dense:
            F.compare(got[k], want[k], dtype, 1e-5 if dtype == np.float32 else 1e-12, floor)
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _same(a, b) -> None:
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
        return
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(8))
def test_vjp_matches_forward_and_backward(family, seed, dtype):
    case = _case(family, seed, dtype)
    f = case.fn
    out, pullback = attnlab.vjp(f, **case.kwargs)
    _same(out, f(**case.kwargs))
    y = out[0] if isinstance(out, tuple) else out
    g_out = np.random.default_rng(seed).standard_normal(y.shape).astype(dtype)
    want = getattr(attnlab, family + "_backward")(g_out, **case.kwargs)
    got = pullback(g_out)
    assert sorted(got) == sorted(want)
    _same_grads(got, want, case)
    again = pullback(g_out)
    for k in want:
        np.testing.assert_array_equal(again[k], got[k], err_msg=k)


@pytest.mark.parametrize("family", FAMILIES)
def test_pullback_sees_the_values_the_forward_saw(family):
    case = _case(family, 3, np.float64)
    kw = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in case.kwargs.items()}
    out, pullback = attnlab.vjp(case.fn, **kw)
    y = out[0] if isinstance(out, tuple) else out
    g_out = np.ones_like(y)
    want = getattr(attnlab, family + "_backward")(g_out, **case.kwargs)
    for v in kw.values():  # the caller reuses its buffers
        if isinstance(v, np.ndarray) and v.dtype.kind == "f":
            v[...] *= 3.0  # in place
    _same_grads(pullback(g_out), want, case)


def _mha_kwargs(rng, dtype=np.float64):
    x = rng.standard_normal((2, 7, 8)).astype(dtype)
    w = {n: (rng.standard_normal((8, 8)) / 3).astype(dtype) for n in ("w_q", "w_k", "w_v", "w_o")}
    return dict(query=x, num_heads=2, causal=True, **w)


def _count_kernels(
    monkeypatch, prefix: str = "mha", recompute: str = "backward + forward"
) -> list[tuple[str, object]]:
    """Records every call of a family's forward and backward kernels (``<prefix>_forward``,
    ``<prefix>_backward``) with the state it got: a backward given the forward's kept state
    runs no forward inside; one without it is labelled ``recompute``."""
    from attnlab._loader import core

    calls: list[tuple[str, object]] = []
    fwd, bwd = getattr(core, prefix + "_forward"), getattr(core, prefix + "_backward")

    def count_fwd(*a):
        # the state follows out (and mha's weights); the bf16 flag after it
        calls.append(("forward", a[3] if prefix == "mha" else a[2]))
        return fwd(*a)

    def count_bwd(*a):
        state = a[3] if prefix == "mha" else a[-1]  # (mha_backward's last: the q/k transforms)
        calls.append(("backward from state" if state is not None else recompute, state))
        return bwd(*a)

    monkeypatch.setattr(core, prefix + "_forward", count_fwd)
    monkeypatch.setattr(core, prefix + "_backward", count_bwd)
    return calls


def test_mha_pullback_runs_no_forward(monkeypatch):
    """The pullback calls the backward kernel with the kept state and never the forward."""
    calls = _count_kernels(monkeypatch)
    kw = _mha_kwargs(np.random.default_rng(0))
    out, pullback = attnlab.vjp(attnlab.multi_head_attention, **kw)
    pullback(np.ones_like(out))
    assert [c[0] for c in calls] == ["forward", "backward from state"]
    assert isinstance(calls[1][1], dict) and calls[1][1] is calls[0][1]  # the kept state


@pytest.mark.parametrize(
    "family", ["multi_head_attention", "scaled_dot_product_attention", "bilinear_attention"]
)
def test_kernel_backward_reads_the_kept_state(family):
    """Spoiling the kept state changes the gradients: the C++ backward used it rather than
    recomputing the forward."""
    from attnlab._vjp import KEPT

    rng = np.random.default_rng(1)
    if family == "scaled_dot_product_attention":
        q, k, v = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
        kw = dict(q=q, k=k, v=v, causal=True)
    elif family == "multi_head_attention":
        kw = _mha_kwargs(rng)
    else:
        m = _mha_kwargs(rng)
        qk = attnlab.collapse_qk(m["w_q"], m["w_k"], num_heads=2)
        kw = dict(query=m["query"], w_qk=qk, w_v=m["w_v"], w_o=m["w_o"], num_heads=2)
    f = getattr(attnlab, family)
    keep: dict = {}
    out = f(**kw, _keep=keep)
    g = np.ones_like(out)
    clean = KEPT[f](keep, g)
    state = keep["state"] if "state" in keep else {"out": keep["out"], "lse": keep["lse"]}
    assert state is not None  # bilinear in the query order here
    for arr in state.values():
        arr[...] = 0.5
    spoiled = KEPT[f](keep, g)
    assert any(not np.allclose(spoiled[k], clean[k]) for k in clean)


def test_vjp_refuses_other_functions():
    with pytest.raises(TypeError, match=r"f: expected one of attnlab.multi_head_attention"):
        attnlab.vjp(np.dot, np.ones(2), np.ones(2))
    with pytest.raises(TypeError):
        attnlab.vjp(attnlab.multi_head_attention, np.ones((2, 4)), nonsense=1)


def test_layer_training_step_runs_one_forward(monkeypatch):
    from attnlab import layers, optim

    layer = layers.MultiHeadAttention(8, 2, seed=0)
    opt = optim.Adam(layer, lr=1e-2)
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    calls = _count_kernels(monkeypatch)
    for _ in range(3):
        out = layer(x, causal=True)
        layer.backward(2 * out)
        opt.step()
    assert [c[0] for c in calls] == ["forward", "backward from state"] * 3


def test_torch_training_step_runs_one_forward(monkeypatch):
    torch = pytest.importorskip("torch")
    import attnlab.torch as at

    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((2, 5, 8)), requires_grad=True)
    w = {
        n: torch.tensor(rng.standard_normal((8, 8)) / 3, requires_grad=True)
        for n in ("w_q", "w_k", "w_v", "w_o")
    }
    calls = _count_kernels(monkeypatch)
    for _ in range(2):
        loss = at.multi_head_attention(x, num_heads=2, causal=True, **w).square().sum()
        loss.backward()
    assert [c[0] for c in calls] == ["forward", "backward from state"] * 2
    assert x.grad is not None and all(t.grad is not None for t in w.values())


def test_vjp_with_rotary_embeddings_matches_the_backward(monkeypatch):
    """With rotary embeddings the forward keeps its projections (before the rotation) like any
    other call: the pullback runs the backward from that state, on private copies."""
    kw = _mha_kwargs(np.random.default_rng(4))
    kw.update(rope_theta=10000.0)
    calls = _count_kernels(monkeypatch)
    out, pullback = attnlab.vjp(attnlab.multi_head_attention, **kw)
    np.testing.assert_array_equal(out, attnlab.multi_head_attention(**kw))
    g = np.random.default_rng(5).standard_normal(out.shape)
    want = attnlab.multi_head_attention_backward(g, **kw)
    kw["query"] *= 2  # the caller's array changes; the pullback does not see it
    got = pullback(g)
    assert [c[0] for c in calls] == [
        "forward",
        "forward",
        "backward + forward",
        "backward from state",
    ]
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_kept_masks_are_not_materialised():
    """vjp keeps its own copy of a broadcast mask as the distinct data, broadcast again: a
    (n_q, n_k) causal-style mask shared by batch and heads stays (n_q, n_k) in memory."""
    from attnlab._vjp import KEPT

    rng = np.random.default_rng(7)
    kw = _mha_kwargs(rng)
    kw["query"] = rng.standard_normal((4, 64, 8))
    kw["mask"] = np.tril(np.ones((64, 64), bool))
    keep: dict = {}
    out = attnlab.multi_head_attention(**kw, _keep=keep)
    m4 = keep["prepared"].m.mask4
    assert m4.shape == (4, 2, 64, 64) and m4.strides[:2] == (0, 0)
    # The kept copies share one buffer (the query, 16 KiB, the weights, 2 KiB, and the mask):
    # less than the mask alone materialised (32 KiB) when only its distinct 4 KiB are copied.
    assert m4.base is not None and m4.base.nbytes < m4.size * m4.itemsize
    want = attnlab.multi_head_attention_backward(np.ones_like(out), **kw)
    kw["mask"][:] = False  # the caller's mask changes; the kept copy does not
    got = KEPT[attnlab.multi_head_attention](keep, np.ones_like(out))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_self_attention_input_kept_once(dtype):
    """Self-attention (key and value omitted): vjp keeps one copy of the input, whatever its
    dtype, so the pullback sees one X (the C++ backward transposes it once for the three weight
    gradients); float16 and bfloat16 inputs kept three copies before."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(8)
    kw = _mha_kwargs(rng, dtype)
    keep: dict = {}
    out = attnlab.multi_head_attention(**kw, _keep=keep)
    a = keep["prepared"]
    assert a.rq is a.rk and a.rk is a.rv
    g = np.ones_like(out)
    got = attnlab.vjp(attnlab.multi_head_attention, **kw)[1](g)
    want = attnlab.multi_head_attention_backward(g, **kw)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ----------------------------------------------------------------- additive and separable


def _pooled_case(family: str, rng, dtype, *, batch, n, widths, variant, biases, padded):
    """Arguments of additive_attention (widths d_in, D, d_out) or separable_attention (d,
    d_out); ``padded``: a key padding mask with padded tokens and, when batched, one batch
    element with no real token."""
    if family == "additive_attention":
        d_in, D, d_out = widths
        kw = additive_args(rng, d_in, D, d_out, biases=biases, dtype=dtype)
        kw["variant"] = variant
    else:
        d_in, d_out = widths
        kw = {
            "w_qkv": (rng.standard_normal((d_in, 1 + 2 * d_in)) * 0.5).astype(dtype),
            "w_o": (rng.standard_normal((d_in, d_out)) * 0.5).astype(dtype),
        }
        if biases:
            kw["b_qkv"] = (rng.standard_normal(1 + 2 * d_in) * 0.3).astype(dtype)
            kw["b_o"] = (rng.standard_normal(d_out) * 0.3).astype(dtype)
    kw["x"] = rng.standard_normal((*batch, n, d_in)).astype(dtype)
    if padded:
        m = rng.random((*batch, n)) < 0.7
        m[..., 0] = True
        if batch:
            m.reshape(-1, n)[-1] = False  # a sequence with no real token
        kw["key_padding_mask"] = m
        kw["warn_empty_rows"] = False
    return kw


POOLED_SHAPES = [  # (batch, n, additive widths (d_in, D, d_out), separable widths (d, d_out))
    ((), 1, (3, 4, 2), (3, 2)),
    ((2,), 7, (4, 6, 5), (4, 5)),
    ((3,), 129, (8, 16, 8), (8, 8)),  # two row blocks, the second of one row
    ((2, 2), 300, (5, 12, 3), (6, 4)),  # several blocks, two leading batch axes
    ((1,), 1030, (4, 8, 8), (4, 8)),  # more rows than one output task
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", range(len(POOLED_SHAPES)))
@pytest.mark.parametrize(
    "family, variant",
    [
        ("additive_attention", "official"),
        ("additive_attention", "hf"),
        ("separable_attention", None),
    ],
)
@pytest.mark.parametrize("biases, padded", [(True, False), (False, True), (True, True)])
def test_pooled_pullback_is_the_backward_bitwise(family, variant, shape, dtype, biases, padded):
    """The pullback reads the kept state; *_backward runs the forward's pooling again: the same
    gradients bit for bit, twice, and after the caller's arrays changed in place."""
    batch, n, wa, ws = POOLED_SHAPES[shape]
    rng = np.random.default_rng(shape * 7 + padded)
    widths = wa if family == "additive_attention" else ws
    kw = _pooled_case(
        family, rng, dtype, batch=batch, n=n, widths=widths, variant=variant, biases=biases,
        padded=padded,
    )  # fmt: skip
    f = getattr(attnlab, family)
    mine = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    out, pullback = attnlab.vjp(f, **mine)
    np.testing.assert_array_equal(out, f(**kw))
    g = rng.standard_normal(out.shape).astype(dtype)
    want = getattr(attnlab, family + "_backward")(g, **kw)
    for v in mine.values():  # the caller reuses its buffers
        if isinstance(v, np.ndarray):
            v[...] = np.logical_not(v) if v.dtype == bool else v * 3 - 1
    got = pullback(g)
    again = pullback(g)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        np.testing.assert_array_equal(again[k], want[k], err_msg=k)
        assert np.isfinite(got[k]).all(), k


def _count_pooled(monkeypatch, family: str) -> list[tuple[str, object]]:
    """:func:`_count_kernels` for a pooled family (its backward without state re-pools)."""
    prefix = "additive" if family == "additive_attention" else "separable"
    return _count_kernels(monkeypatch, prefix, "backward + pooling")


@pytest.mark.parametrize("family", ["additive_attention", "separable_attention"])
def test_pooled_pullback_runs_no_forward(monkeypatch, family):
    """The forward kernel runs once, filling the state; the pullback calls only the backward
    kernel, with that state."""
    calls = _count_pooled(monkeypatch, family)
    widths = (4, 6, 5) if family == "additive_attention" else (4, 5)
    kw = _pooled_case(
        family, np.random.default_rng(2), np.float64, batch=(2,), n=9, widths=widths,
        variant="official", biases=True, padded=True,
    )  # fmt: skip
    out, pullback = attnlab.vjp(getattr(attnlab, family), **kw)
    pullback(np.ones_like(out))
    pullback(np.ones_like(out))
    assert [c[0] for c in calls] == ["forward", "backward from state", "backward from state"]
    assert isinstance(calls[0][1], dict) and calls[1][1] is calls[0][1] is calls[2][1]
    calls.clear()
    getattr(attnlab, family + "_backward")(np.ones_like(out), **kw)
    assert [c[0] for c in calls] == ["backward + pooling"]


@pytest.mark.parametrize("family", ["additive_attention", "separable_attention"])
def test_pooled_backward_reads_the_kept_state(family):
    """Spoiling the kept state changes the gradients: the kernel used it rather than running
    the pooling again."""
    from attnlab._vjp import KEPT

    widths = (4, 6, 5) if family == "additive_attention" else (4, 5)
    kw = _pooled_case(
        family, np.random.default_rng(3), np.float64, batch=(2,), n=9, widths=widths,
        variant="official", biases=True, padded=False,
    )  # fmt: skip
    f = getattr(attnlab, family)
    keep: dict = {}
    out = f(**kw, _keep=keep)
    g = np.ones_like(out)
    clean = KEPT[f](keep, g)
    for name, arr in keep["state"].items():
        saved = arr.copy()
        arr[...] = 0.5
        spoiled = KEPT[f](keep, g)
        assert any(not np.array_equal(spoiled[k], clean[k]) for k in clean), name
        arr[...] = saved
    restored = KEPT[f](keep, g)
    for k in clean:
        np.testing.assert_array_equal(restored[k], clean[k], err_msg=k)


def test_pooled_state_is_linear_in_n():
    """What vjp keeps for the pooled families: O(n d) (no n x n), the sizes of AdditiveState
    and SeparableState."""
    B, n = 2, 50
    kw = _pooled_case(
        "additive_attention", np.random.default_rng(4), np.float32, batch=(B,), n=n,
        widths=(4, 6, 5), variant="official", biases=True, padded=False,
    )  # fmt: skip
    keep: dict = {}
    attnlab.additive_attention(**kw, _keep=keep)
    assert sum(a.size for a in keep["state"].values()) == B * n * (2 * 6 + 3) + B * (6 + 1)
    assert all(a.dtype == np.float32 for a in keep["state"].values())
    kw = _pooled_case(
        "separable_attention", np.random.default_rng(4), np.float32, batch=(B,), n=n,
        widths=(4, 5), variant=None, biases=True, padded=False,
    )  # fmt: skip
    keep = {}
    attnlab.separable_attention(**kw, _keep=keep)
    assert sum(a.size for a in keep["state"].values()) == B * n * (2 * 4 + 1) + B * 4


def test_pooled_pullback_bitwise_for_any_thread_count():
    """The kept state and the pullback are the same for 1 and 2 threads."""
    kw = _pooled_case(
        "additive_attention", np.random.default_rng(5), np.float32, batch=(3,), n=400,
        widths=(8, 16, 8), variant="official", biases=True, padded=True,
    )  # fmt: skip
    old = attnlab.get_num_threads()
    results = []
    try:
        for k in (1, 2):
            attnlab.set_num_threads(k)
            out, pullback = attnlab.vjp(attnlab.additive_attention, **kw)
            results.append(pullback(np.ones_like(out)))
    finally:
        attnlab.set_num_threads(old)
    for k in results[0]:
        np.testing.assert_array_equal(results[0][k], results[1][k], err_msg=k)


def test_pooled_layer_training_step_runs_one_forward(monkeypatch):
    from attnlab import layers, optim

    layer = layers.SeparableAttention(8, seed=0)
    opt = optim.Adam(layer, lr=1e-2)
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    calls = _count_pooled(monkeypatch, "separable_attention")
    for _ in range(2):
        out = layer(x)
        layer.backward(2 * out)
        opt.step()
    assert [c[0] for c in calls] == ["forward", "backward from state"] * 2


@pytest.mark.parametrize("family", ["additive_attention", "separable_attention"])
@pytest.mark.parametrize("sizes", [(2, 0, 4, 3), (2, 5, 0, 3), (2, 5, 4, 0), (0, 5, 4, 3)])
def test_pooled_pullback_on_empty_sizes(family, sizes):
    """No tokens, no features or no outputs: the kernel may not run, the state stays unfilled
    and unread, and the pullback still equals the backward."""
    B, n, d, d_out = sizes
    widths = (d, 6, d_out) if family == "additive_attention" else (d, d_out)
    kw = _pooled_case(
        family, np.random.default_rng(6), np.float64, batch=(B,), n=n, widths=widths,
        variant="official", biases=True, padded=False,
    )  # fmt: skip
    out, pullback = attnlab.vjp(getattr(attnlab, family), **kw)
    g = np.ones_like(out)
    want = getattr(attnlab, family + "_backward")(g, **kw)
    got = pullback(g)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
