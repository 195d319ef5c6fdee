"""attnlab.latent_attention (DeepSeek's multi-head latent attention): both forms against the
reference and against each other, decoding against a cache, every gradient against finite
differences (float64), vjp, the layer, the torch adapter, the cost model, errors; and the real
transformers modules (DeepseekV2Attention, DeepseekV3Attention) from small configs with random
weights, in float64 and float32, forward (full sequences and decode steps against their cache)
and gradients through attnlab.torch against the modules' autograd.

Tolerances against transformers, float64: the modules compute their RMSNorms in float32 even in
a float64 model (``hidden_states.to(torch.float32)``) and their rotary tables (and YaRN's
frequencies) in float32; with the norms patched to run in the model's dtype and the module's
own frequencies, attnlab agrees to 1e-7 (measured up to 5.2e-8, YaRN the largest: the float32
cos/sin tables); as shipped, to 3e-7 (measured up to 1.3e-7, decode steps). float32: 1e-5
(measured up to 3.0e-7)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import attnlab
from attnlab import reference
from attnlab.cost import latent_cost, plan_latent
from conftest import assert_close

H, D, R, DN, DR, DV, QR = 4, 32, 16, 8, 6, 10, 12


def _weights(rng, lora=False, bias=True, dtype=np.float64):
    def w(*shape, s=0.3):
        return (rng.standard_normal(shape) * s).astype(dtype)

    out = {
        "w_kv_a": w(D, R + DR),
        "kv_a_norm": (1 + w(R)).astype(dtype),
        "w_kv_b": w(R, H * (DN + DV)),
        "w_o": w(H * DV, D),
    }
    if bias:
        out.update(b_kv_a=w(R + DR), b_o=w(D))
    if lora:
        out.update(w_q_a=w(D, QR), q_a_norm=(1 + w(QR)).astype(dtype), w_q_b=w(QR, H * (DN + DR)))
        if bias:
            out["b_q_a"] = w(QR)
    else:
        out["w_q"] = w(D, H * (DN + DR))
    return out


FORMS = ["expanded", "absorbed"]


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_matches_reference(form, lora, interleave):
    rng = np.random.default_rng(0)
    w = _weights(rng, lora)
    x = rng.standard_normal((2, 7, D))
    kw = dict(num_heads=H, rope_theta=1e4, rope_interleave=interleave, causal=True)
    ref = reference.latent_attention(x, **w, **kw)
    got = attnlab.latent_attention(x, **w, **kw, form=form)
    assert_close(got, ref, np.float64, "latent vs reference")
    got32 = attnlab.latent_attention(
        x.astype(np.float32), **{k: v.astype(np.float32) for k, v in w.items()}, **kw, form=form
    )
    assert_close(got32, ref, np.float32, "latent vs reference")


@pytest.mark.parametrize(
    "options",
    [
        {"causal": "bottom_right"},
        {"window": (2, 0), "causal": True},
        {"softcap": 2.0, "causal": True},
        {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
        {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
        {"mask": "float"},
        {"mask": "bool", "key_padding_mask": "kp"},
        {"scale": 0.3, "rope_scale": 1.3, "positions": np.array([3, 1, 4, 1, 5, 9, 2])},
        {"rope_inv_freq": np.array([1.0, 0.1, 0.01]), "norm_eps": 1e-3},
    ],
    ids="-".join,
)
@pytest.mark.parametrize("form", FORMS)
def test_options_and_weights(form, options):
    rng = np.random.default_rng(1)
    w = _weights(rng, lora=True)
    x = rng.standard_normal((2, 7, D))
    o = dict(options)
    if o.get("mask") == "float":
        o["mask"] = rng.standard_normal((H, 7, 7))
    elif o.get("mask") == "bool":
        o["mask"] = rng.random((2, 1, 7, 7)) < 0.7
        o["mask"][..., 0] = True
    if o.get("key_padding_mask") == "kp":
        o["key_padding_mask"] = np.array([[True] * 7, [True] * 5 + [False] * 2])
    if "rope_inv_freq" not in o:
        o["rope_theta"] = 1e4
    kw = dict(num_heads=H, **o, return_weights=True, return_lse=True)
    ref = reference.latent_attention(x, **w, **kw)
    got = attnlab.latent_attention(x, **w, **kw, form=form)
    for g, r_, what in zip(got, ref, ("out", "weights", "lse"), strict=True):
        assert_close(g, r_, np.float64, f"latent {what}")


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_decode_against_the_cache(form, lora):
    """Prefill 6 tokens returning the cache, then 1 and then 2 tokens against it: equal to the
    full causal sequence; the cache grows by the new tokens' latents."""
    rng = np.random.default_rng(2)
    w = _weights(rng, lora)
    x = rng.standard_normal((2, 9, D))
    kw = dict(num_heads=H, rope_theta=1e4)
    full = reference.latent_attention(x, **w, **kw, causal=True)
    out, cache = attnlab.latent_attention(
        x[:, :6], **w, **kw, causal=True, return_cache=True, form=form
    )
    assert cache.shape == (2, 6, R + DR)
    assert_close(out, full[:, :6], np.float64, "prefill")
    step, cache = attnlab.latent_attention(
        x[:, 6:7], **w, **kw, cache=cache, causal="bottom_right", return_cache=True, form=form
    )
    assert_close(step, full[:, 6:7], np.float64, "decode 1")
    step2, cache = attnlab.latent_attention(
        x[:, 7:], **w, **kw, cache=cache, causal="bottom_right", return_cache=True, form=form
    )
    assert_close(step2, full[:, 7:], np.float64, "decode 2")
    _, whole = attnlab.latent_attention(x, **w, **kw, return_cache=True)
    np.testing.assert_allclose(cache, whole, rtol=0, atol=1e-13)


def test_forms_agree_and_auto_follows_the_plan():
    rng = np.random.default_rng(3)
    w = _weights(rng, True)
    x = rng.standard_normal((1, 40, D))
    kw = dict(num_heads=H, rope_theta=1e4, causal=True)
    e = attnlab.latent_attention(x, **w, **kw, form="expanded")
    a = attnlab.latent_attention(x, **w, **kw, form="absorbed")
    np.testing.assert_allclose(e, a, rtol=0, atol=1e-13)
    sizes = dict(
        d_model=D,
        num_heads=H,
        kv_lora_rank=R,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        v_head_dim=DV,
        q_lora_rank=QR,
    )
    assert plan_latent(n_q=1, n_k=4096, **sizes) == "absorbed"
    assert plan_latent(n_q=512, **sizes) == "expanded"
    for n_q, n_k in ((1, 4096), (512, 512), (64, 4096)):
        costs = {f: latent_cost(f, n_q=n_q, n_k=n_k, **sizes)["flops"] for f in FORMS}
        assert plan_latent(n_q=n_q, n_k=n_k, **sizes) == min(FORMS, key=lambda f: costs[f])
    c = latent_cost("absorbed", n_q=1, n_k=10, **sizes)
    assert c["cache_bytes_per_token"] == (R + DR) * 4


@pytest.mark.parametrize("options", ["none", "key_padding_mask", "softcap", "mask", "weights"])
def test_decode_step_over_a_long_cache(options):
    """One query against a cache long enough to be cut into key parts (two whole parts and a
    shorter last one, merged by their log-sum-exps): the absorbed step equals the reference and
    the expanded step, output, log-sum-exp and gradients; a mask array or the weights run the
    call whole."""
    rng = np.random.default_rng(11)
    w = _weights(rng, True)
    n_past = 2 * 512 + 300
    x = rng.standard_normal((2, 1, D))
    cache = rng.standard_normal((2, n_past, R + DR))
    kw = dict(num_heads=H, rope_theta=1e4, causal="bottom_right", return_lse=True)
    if options == "key_padding_mask":
        kp = np.ones((2, n_past + 1), bool)
        kp[0, 100:700] = False  # a whole part and pieces of two more
        kp[1, 1024:] = False  # the last part, and the new token's own key
        kw["key_padding_mask"] = kp
    elif options == "softcap":
        kw["softcap"] = 1.5
    elif options == "mask":
        kw["mask"] = rng.standard_normal((2, H, 1, n_past + 1))
    elif options == "weights":
        kw["return_weights"] = True
    ref = reference.latent_attention(x, **w, **kw, cache=cache)
    got = attnlab.latent_attention(x, **w, **kw, cache=cache, form="absorbed")
    exp = attnlab.latent_attention(x, **w, **kw, cache=cache, form="expanded")
    for g, e, r_ in zip(got, exp, ref, strict=True):
        assert_close(g, r_, np.float64, "long decode step")
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-12)
    kw.pop("return_lse")
    G = rng.standard_normal((2, 1, D))
    ga = attnlab.latent_attention_backward(G, x, **w, **kw, cache=cache, form="absorbed")
    ge = attnlab.latent_attention_backward(G, x, **w, **kw, cache=cache, form="expanded")
    for k in ge:
        np.testing.assert_allclose(ga[k], ge[k], rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("serial", [0, 1 << 40], ids=["attnlab-gemm", "numpy-matmul"])
@pytest.mark.parametrize("n", [1, 5])
def test_absorbed_per_head_products_either_way(monkeypatch, serial, n):
    """The absorbed form's per-head products on NumPy's matmul (a decode step's size) and on
    attnlab's GEMM (larger ones): both equal to the reference."""
    from attnlab import _latent

    monkeypatch.setattr(_latent, "_BLAS_SERIAL", serial)
    rng = np.random.default_rng(13)
    w = _weights(rng, True)
    x = rng.standard_normal((2, n, D))
    cache = rng.standard_normal((2, 4, R + DR))
    kw = dict(num_heads=H, rope_theta=1e4, causal="bottom_right", cache=cache)
    ref = reference.latent_attention(x, **w, **kw)
    got = attnlab.latent_attention(x, **w, **kw, form="absorbed")
    assert_close(got, ref, np.float64, "absorbed products")


def test_returned_cache_is_the_callers():
    """The cache comes back without a copy, and writing into it changes neither a later call
    nor what attnlab.vjp kept for its pullback."""
    rng = np.random.default_rng(12)
    w = _weights(rng, False)
    x = rng.standard_normal((2, 3, D))
    kw = dict(num_heads=H, rope_theta=1e4, causal=True, return_cache=True)
    (out, cache), pullback = attnlab.vjp(attnlab.latent_attention, x, **w, **kw)
    G = rng.standard_normal(out.shape)
    before = pullback(G)
    cache[...] = np.nan
    after = pullback(G)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    out2, cache2 = attnlab.latent_attention(x, **w, **kw)
    np.testing.assert_array_equal(out2, out)
    assert np.isfinite(cache2).all()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", [1, 3, 0])
def test_gradient_through_the_returned_cache(form, n):
    """``(grad_out, grad_cache)``: the cotangent of the returned cache reaches x, the key-value
    weights and the cache given, against finite differences of sum(out G) + sum(cache G_c);
    the vjp pullback takes the same pair."""
    rng = np.random.default_rng(14)
    w = _weights(rng, True)
    args = dict(x=rng.standard_normal((2, n, D)), cache=rng.standard_normal((2, 4, R + DR)), **w)
    kw = dict(num_heads=H, rope_theta=1e4, causal="bottom_right", form=form)
    G = rng.standard_normal((2, n, D))
    Gc = rng.standard_normal((2, 4 + n, R + DR))

    def f(**a):
        out, cache = attnlab.latent_attention(**a, **kw, return_cache=True)
        return np.sum(out * G) + np.sum(cache * Gc)

    g = attnlab.latent_attention_backward((G, Gc), **args, **kw, return_cache=True)
    for name in sorted(args):
        d = rng.standard_normal(np.shape(args[name]))
        eps = 1e-6
        fd = f(**{**args, name: args[name] + eps * d}) - f(**{**args, name: args[name] - eps * d})
        fd /= 2 * eps
        an = np.sum(g[name] * d)
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (name, fd, an)
    _, pullback = attnlab.vjp(attnlab.latent_attention, **args, **kw, return_cache=True)
    got = pullback((G, Gc))
    for k in g:
        np.testing.assert_allclose(got[k], g[k], rtol=1e-12, atol=1e-12, err_msg=k)
    assert set(pullback((G, None))) == set(g)
    with pytest.raises(ValueError, match="grad_cache: expected the returned cache's shape"):
        pullback((G, Gc[:, 1:]))
    with pytest.raises(ValueError, match="grad_out: expected an array or the pair"):
        pullback((G, Gc, Gc))


def test_bench_crossover_tables_and_targets():
    """The bench family's bookkeeping on made-up rows (no timing): the crossover is where
    plan_latent switches, the tables carry both forms and the checks, the targets follow them."""
    from attnlab._bench import latent as bench
    from attnlab._bench.common import Row

    x = bench.crossover(bench.PLAN_KEYS)
    cfg = bench._config()
    assert plan_latent(n_q=x, n_k=bench.PLAN_KEYS, **cfg) == "expanded"
    assert plan_latent(n_q=x - 1, n_k=bench.PLAN_KEYS, **cfg) == "absorbed"
    check = {"pred_ratio": 20.0, "meas_ratio": 25.0, "within_20pct": False, "pred_ms": 9.0}
    check |= {"n": 4096, "gemm_gmacs": 40.0, "attention_gmacs": 20.0, "read_gbs": 8.0}
    check |= {"copy_gbs": 12.0}
    plan = {"n": 100, "plan": "absorbed", "faster": "absorbed", "plan_within_10pct": True}
    rows = [
        Row(
            "latent",
            "MLA decode step fp32",
            "s",
            "expanded",
            200.0,
            extra={"n": 4096, "pred_ms": 180.0},
        ),
        Row("latent", "MLA decode step fp32", "s", "absorbed", 8.0, extra=check),
        Row("latent", "MLA plan sweep fp32", "p", "expanded", 50.0, extra={"n": 100}),
        Row("latent", "MLA plan sweep fp32", "p", "absorbed", 40.0, extra=plan),
    ]
    (_, _, decode), (_, _, sweep) = bench.summary_tables(rows)
    assert decode == [
        [
            "4096",
            "200.0",
            "180.0",
            "8.00",
            "9.00",
            "25.0x",
            "20.0x",
            "NO",
            "40.0",
            "20.0",
            "8.0",
            "12.0",
        ]
    ]
    assert sweep == [["100", "50.0", "40.0", "absorbed", "absorbed", "yes"]]
    met = {t["target"].split(":")[0]: t["met"] for t in bench.targets(rows)}
    assert met == {
        "MLA decode at 4096 cached tokens": False,
        "MLA plan_latent within 10% (1/1 points)": True,
    }


def _fd_check(f, args, grads, names, rng, eps=1e-6, tol=1e-6):
    """Directional finite differences of ``sum(f(**args) * G)`` for each name."""
    out = f(**args)
    G = np.random.default_rng(7).standard_normal(out.shape)
    for name in names:
        d = rng.standard_normal(np.shape(args[name]))
        plus = {**args, name: args[name] + eps * d}
        minus = {**args, name: args[name] - eps * d}
        fd = (np.sum(f(**plus) * G) - np.sum(f(**minus) * G)) / (2 * eps)
        an = np.sum(grads(G)[name] * d)
        assert abs(fd - an) <= tol * max(1.0, abs(fd)), (name, fd, an)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["prefill", "decode", "options"])
def test_gradients_finite_differences(case, form, lora):
    rng = np.random.default_rng(4)
    w = _weights(rng, lora)
    args = dict(x=rng.standard_normal((2, 5, D)), **w)
    kw = dict(num_heads=H, rope_theta=1e4, form=form, causal=True)
    if case == "decode":
        args["x"] = args["x"][:, :1]
        args["cache"] = rng.standard_normal((2, 6, R + DR))
        kw["causal"] = "bottom_right"
    elif case == "options":
        args["cache"] = rng.standard_normal((1, 3, R + DR))
        args["mask"] = rng.standard_normal((H, 5, 8))
        args["sinks"] = rng.standard_normal(H)
        kw.update(causal="bottom_right", softcap=3.0, rope_interleave=False)

    def f(**a):
        return attnlab.latent_attention(**a, **kw)

    def grads(G):
        return attnlab.latent_attention_backward(G, **args, **kw)

    g = grads(np.ones((2, args["x"].shape[1], D)))
    expected = {k for k in args if k not in ("mask", "sinks")} | (
        {"mask", "sinks"} if case == "options" else set()
    )
    assert set(g) == expected
    _fd_check(f, args, grads, sorted(expected), rng)
    # vjp: the same gradients from the forward's state
    out, pullback = attnlab.vjp(attnlab.latent_attention, **args, **kw)
    G = rng.standard_normal(out.shape)
    ref = grads(G)
    got = pullback(G)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-12, atol=1e-12, err_msg=k)


def test_errors_name_the_argument():
    rng = np.random.default_rng(5)
    w = _weights(rng, False)
    x = rng.standard_normal((3, D))
    kw = dict(num_heads=H, rope_theta=1e4)
    f = attnlab.latent_attention
    with pytest.raises(ValueError, match="form: expected"):
        f(x, **w, **kw, form="fast")
    with pytest.raises(ValueError, match="rope_theta: latent attention rotates"):
        f(x, **w, num_heads=H)
    with pytest.raises(ValueError, match="w_q: given with w_q_a"):
        f(x, **w, **kw, w_q_a=np.ones((D, 4)))
    bad = {**w}
    del bad["w_q"]
    with pytest.raises(TypeError, match="w_q_a: expected an array"):
        f(x, **bad, **kw)
    with pytest.raises(ValueError, match=r"kv_a_norm: expected shape \(kv_lora_rank,\)"):
        f(x, **{**w, "kv_a_norm": np.ones(R + 1)}, **kw)
    with pytest.raises(ValueError, match="w_kv_a: expected shape"):
        f(x, **{**w, "w_kv_a": np.ones((D, R + 3))}, **kw)
    with pytest.raises(ValueError, match="w_kv_b: expected 4 heads"):
        f(x, **{**w, "w_kv_b": np.ones((R, 4 * (DN + DV) + 1))}, **kw)
    with pytest.raises(ValueError, match="w_o: expected shape"):
        f(x, **{**w, "w_o": np.ones((H * DV + 1, D))}, **kw)
    with pytest.raises(ValueError, match="cache: expected shape"):
        f(x, **w, **kw, cache=np.ones((2, R)))
    with pytest.raises(ValueError, match="rope_inv_freq: expected shape"):
        f(x, **w, num_heads=H, rope_inv_freq=np.ones(2))
    with pytest.raises(ValueError, match="positions: expected shape"):
        f(x, **w, **kw, positions=np.arange(4))
    with pytest.raises(TypeError, match="rope_interleave"):
        f(x, **w, **kw, rope_interleave="yes")
    with pytest.raises(ValueError, match="n_k: expected the keys"):
        latent_cost(
            "absorbed",
            n_q=4,
            n_k=2,
            d_model=D,
            num_heads=H,
            kv_lora_rank=R,
            qk_nope_head_dim=DN,
            qk_rope_head_dim=DR,
            v_head_dim=DV,
        )


# ---------------------------------------------------------------------------------------------
# The layer and the torch adapter


def test_layer_trains_and_decodes():
    from attnlab.layers import LatentAttention

    layer = LatentAttention(
        D,
        H,
        kv_lora_rank=R,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        v_head_dim=DV,
        q_lora_rank=QR,
        seed=0,
    )
    x = np.random.default_rng(6).standard_normal((2, 5, D))
    y = layer(x, causal=True)
    dx = layer.backward(np.ones_like(y))
    assert dx.shape == x.shape and sorted(layer.grads) == sorted(layer.params)
    ref = attnlab.latent_attention_backward(
        np.ones_like(y), x, **layer.params, **layer._functional_kwargs(), causal=True
    )
    for k, v in layer.grads.items():
        np.testing.assert_allclose(v, ref[k], rtol=1e-12, atol=1e-12)
    _, cache = layer(x[:, :4], causal=True, return_cache=True)
    step = layer(x[:, 4:], cache=cache, causal="bottom_right")
    np.testing.assert_allclose(step, y[:, 4:], rtol=0, atol=1e-12)


def test_torch_adapter_matches_numpy():
    torch = pytest.importorskip("torch")
    import attnlab.torch as at

    rng = np.random.default_rng(8)
    w = _weights(rng, True)
    x = rng.standard_normal((2, 5, D))
    kw = dict(num_heads=H, rope_theta=1e4, causal=True)
    tw = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    out = at.latent_attention(tx, **tw, **kw)
    G = rng.standard_normal(out.shape)
    (out * torch.tensor(G)).sum().backward()
    ref = attnlab.latent_attention_backward(G, x, **w, **kw)
    np.testing.assert_allclose(out.detach().numpy(), attnlab.latent_attention(x, **w, **kw))
    np.testing.assert_allclose(tx.grad.numpy(), ref["x"], rtol=1e-12, atol=1e-12)
    for k, t in tw.items():
        np.testing.assert_allclose(t.grad.numpy(), ref[k], rtol=1e-12, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("form", FORMS)
def test_torch_adapter_lse_cache_and_decoding_through_the_cache(form):
    """return_lse and return_cache through the adapter: the values the NumPy function returns,
    the log-sum-exp not differentiable; a loss over a prefill and two decode steps, each fed the
    cache the one before returned, has torch autograd's gradients equal to one causal call over
    the whole sequence (the cache carries the gradient back)."""
    torch = pytest.importorskip("torch")
    import attnlab.torch as at

    rng = np.random.default_rng(15)
    w = _weights(rng, True)
    x = rng.standard_normal((2, 7, D))
    kw = dict(num_heads=H, rope_theta=1e4, form=form)
    G = rng.standard_normal((2, 7, D))
    want = attnlab.latent_attention(
        x[:, :4], **w, **kw, causal=True, return_lse=True, return_cache=True
    )
    tw = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    out, lse, cache = at.latent_attention(
        tx[:, :4], **tw, **kw, causal=True, return_lse=True, return_cache=True
    )
    for t, a in zip((out, lse, cache), want, strict=True):
        np.testing.assert_allclose(t.detach().numpy(), a, rtol=0, atol=1e-13)
    assert not lse.requires_grad and cache.requires_grad
    loss = (out * torch.tensor(G[:, :4])).sum()
    for i in (4, 5):  # decode steps of 1 and 2 tokens
        j = i + 1 if i == 4 else 7
        step, cache = at.latent_attention(
            tx[:, i:j], **tw, **kw, cache=cache, causal="bottom_right", return_cache=True
        )
        loss = loss + (step * torch.tensor(G[:, i:j])).sum()
    loss.backward()
    ref = attnlab.latent_attention_backward(G, x, **w, **kw, causal=True)
    np.testing.assert_allclose(tx.grad.numpy(), ref["x"], rtol=1e-10, atol=1e-12)
    for k, t in tw.items():
        np.testing.assert_allclose(t.grad.numpy(), ref[k], rtol=1e-10, atol=1e-12, err_msg=k)


# ---------------------------------------------------------------------------------------------
# The real transformers modules

torch_ = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
MODULES = [
    ("V3", None, None, True),
    ("V3", 24, None, True),
    ("V3", None, YARN, True),
    ("V3", 24, YARN, False),
    ("V2", None, None, True),
    ("V2", 24, YARN, True),
]
N = 9


def _module(version, lora, rope, interleave, dtype, impl="sdpa"):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3

    kw = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=lora,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=64,
        attention_bias=True,
    )
    if rope is not None:
        kw["rope_parameters"] = dict(rope)
    if version == "V3":
        cfg = T.DeepseekV3Config(**kw, rope_interleave=interleave)
        cls, rot = m3.DeepseekV3Attention, m3.DeepseekV3RotaryEmbedding
    else:
        cfg = T.DeepseekV2Config(**kw)
        cls, rot = m2.DeepseekV2Attention, m2.DeepseekV2RotaryEmbedding
    cfg._attn_implementation = impl
    m = cls(cfg, 0).to(dtype).eval()
    gen = torch_.Generator().manual_seed(0)
    with torch_.no_grad():
        for name, p in m.named_parameters():
            scale = 0.3 if p.ndim == 1 else p.shape[1] ** -0.5
            p.copy_(torch_.randn(p.shape, generator=gen, dtype=dtype) * scale)
            if "norm" in name:
                p.add_(1)
    return m, rot(cfg), cfg


def _call(m, x, pe, mask, cache=None):
    # transformers 5.24 names the cache argument `cache` (`past_key_values` before)
    key = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
    kwargs = {"position_embeddings": pe, "attention_mask": mask, key: cache}
    return m(x, **kwargs)[0]


def _exact_norms(m):
    """The module's RMSNorms in the model's dtype (transformers rounds them to float32)."""
    for mod in m.modules():
        if type(mod).__name__.endswith("RMSNorm"):

            def forward(hs, mod=mod):
                var = hs.pow(2).mean(-1, keepdim=True)
                return mod.weight * (hs * torch_.rsqrt(var + mod.variance_epsilon))

            mod.forward = forward


def _causal(n_q, n_k):
    return torch_.from_numpy(np.tril(np.ones((n_q, n_k), bool), n_k - n_q))[None, None]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch_.float64, torch_.float32], ids=str)
@pytest.mark.parametrize("version,lora,rope,interleave", MODULES)
def test_transformers_module(version, lora, rope, interleave, dtype, form):
    """A full causal sequence, then a prefill of 6 tokens into transformers' DynamicCache and
    decode steps of 1 and 2 tokens against it; attnlab from from_transformers' kwargs, its own
    cache from return_cache."""
    from attnlab.interop import from_transformers

    m, rot, cfg = _module(version, lora, rope, interleave, dtype)
    gen = torch_.Generator().manual_seed(1)
    x = torch_.randn(2, N, 64, generator=gen, dtype=dtype)
    pos = torch_.arange(N)[None].expand(2, N)
    kw = from_transformers(m, rope_length=N)
    assert kw.pop("causal") is True
    assert kw["rope_interleave"] == (interleave or version == "V2")
    assert ("rope_inv_freq" in kw) == (rope is not None)
    np_ = np.float64 if dtype == torch_.float64 else np.float32
    tol = 3e-7 if dtype == torch_.float64 else 1e-5
    with torch_.no_grad():
        ref = _call(m, x, rot(x, pos), _causal(N, N))
        got = attnlab.latent_attention(x.numpy(), **kw, causal=True, form=form)
        assert_close(got, ref.numpy(), np_, f"Deepseek{version}", tol)
        cache = T.DynamicCache(config=cfg)
        _call(m, x[:, :6], rot(x, pos[:, :6]), _causal(6, 6), cache)
        _, ours = attnlab.latent_attention(
            x[:, :6].numpy(), **kw, causal=True, return_cache=True, form=form
        )
        for lo, hi in ((6, 7), (7, N)):
            step = _call(m, x[:, lo:hi], rot(x, pos[:, lo:hi]), _causal(hi - lo, hi), cache)
            mine, ours = attnlab.latent_attention(
                x[:, lo:hi].numpy(),
                **kw,
                cache=ours,
                causal="bottom_right",
                return_cache=True,
                form=form,
            )
            assert_close(mine, step.numpy(), np_, f"Deepseek{version} decode", tol)
    if dtype == torch_.float64:  # exact norms, the module's own frequencies: 1e-7
        _exact_norms(m)
        with torch_.no_grad():
            ref = _call(m, x, rot(x, pos), _causal(N, N))
        if "rope_inv_freq" in kw:
            kw["rope_inv_freq"] = rot.inv_freq.double().numpy()
        got = attnlab.latent_attention(x.numpy(), **kw, causal=True, form=form)
        assert_close(got, ref.numpy(), np.float64, f"Deepseek{version} exact norms", 1e-7)


@pytest.mark.parametrize("version,lora,rope,interleave", MODULES)
def test_transformers_gradients(version, lora, rope, interleave):
    """float32: gradients through attnlab.torch (input, every weight and norm) equal the
    module's autograd."""
    import attnlab.torch as at
    from attnlab.interop import from_transformers

    m, rot, _ = _module(version, lora, rope, interleave, torch_.float32)
    gen = torch_.Generator().manual_seed(2)
    x = torch_.randn(2, N, 64, generator=gen).requires_grad_(True)
    pos = torch_.arange(N)[None].expand(2, N)
    kw = from_transformers(m, rope_length=N)
    kw.pop("causal")
    out = _call(m, x, rot(x, pos), _causal(N, N))
    G = torch_.randn(out.shape, generator=gen)
    names = {
        "w_q": "q_proj",
        "w_q_a": "q_a_proj",
        "w_q_b": "q_b_proj",
        "w_kv_a": "kv_a_proj_with_mqa",
        "w_kv_b": "kv_b_proj",
        "w_o": "o_proj",
    }
    pairs = []
    for ours, lin in names.items():
        if ours in kw:
            pairs.append((ours, getattr(m, lin).weight, True))
            b = ours.replace("w_", "b_")
            if b in kw:
                pairs.append((b, getattr(m, lin).bias, False))
    for ours, norm in (("q_a_norm", "q_a_layernorm"), ("kv_a_norm", "kv_a_layernorm")):
        if ours in kw:
            pairs.append((ours, getattr(m, norm).weight, False))
    theirs = torch_.autograd.grad((out * G).sum(), [x] + [p for _, p, _ in pairs])
    leaves = {n: torch_.tensor(kw[n], requires_grad=True) for n, _, _ in pairs}
    consts = {k: v for k, v in kw.items() if k not in leaves}
    xa = x.detach().clone().requires_grad_(True)
    for form in FORMS:
        mine = at.latent_attention(xa, **consts, **leaves, causal=True, form=form)
        grads = torch_.autograd.grad((mine * G).sum(), [xa, *leaves.values()])
        assert_close(mine.detach().numpy(), out.detach().numpy(), np.float32, "module", 1e-5)
        assert_close(grads[0].numpy(), theirs[0].numpy(), np.float32, "grad x", 2e-5)
        for (n, _, transposed), a, b in zip(pairs, grads[1:], theirs[1:], strict=True):
            theirs_n = b.T if transposed else b
            assert_close(a.numpy(), theirs_n.numpy(), np.float32, f"grad {n}", 2e-5)
