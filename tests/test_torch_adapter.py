"""attnlab.torch: autograd Functions over attnlab's kernels, against torch's own attention.

Outputs and gradients are compared with nn.MultiheadAttention, F.scaled_dot_product_attention,
a plain torch bilinear attention, Hugging Face's SwiftFormer and MobileViT-v2 modules and the
official SwiftFormer module (float32, normwise relative error <= 1e-5); torch.autograd.gradcheck
runs on every function in float64.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnlab  # noqa: E402
import attnlab.torch as at  # noqa: E402
from attnlab.interop import torch_masks  # noqa: E402
from conftest import assert_close  # noqa: E402
from torch_modules import official_swiftformer_module  # noqa: E402

nn = torch.nn
F = torch.nn.functional
F32 = np.float32


def _np(t):
    return t.detach().numpy()


def _grads_close(params_ref, params_got, label):
    for (name, a), (_, b) in zip(params_ref, params_got, strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert_close(_np(b.grad), _np(a.grad), F32, label)


# --------------------------------------------------------------------------- multi-head


def _mha(E, h, **kw):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, h, batch_first=True, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.uniform_(-0.3, 0.3)
    return m.eval()


def _mha_kwargs(m):
    """attnlab weights as differentiable views of the module's parameters."""
    E = m.embed_dim
    if m.in_proj_weight is not None:
        W = m.in_proj_weight
        w = dict(w_q=W[:E].t(), w_k=W[E : 2 * E].t(), w_v=W[2 * E :].t())
    else:
        w = dict(w_q=m.q_proj_weight.t(), w_k=m.k_proj_weight.t(), w_v=m.v_proj_weight.t())
    if m.in_proj_bias is not None:
        b = m.in_proj_bias
        w.update(b_q=b[:E], b_k=b[E : 2 * E], b_v=b[2 * E :])
    w["w_o"] = m.out_proj.weight.t()
    if m.out_proj.bias is not None:
        w["b_o"] = m.out_proj.bias
    return dict(w, num_heads=m.num_heads)


@pytest.mark.parametrize("cross", [False, True])
def test_mha_matches_torch_outputs_and_gradients(cross):
    E, h = 16, 4
    m_ref = _mha(E, h, kdim=6 if cross else None, vdim=10 if cross else None)
    m_got = copy.deepcopy(m_ref)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 5, E, generator=gen)
    k = torch.randn(3, 7, 6, generator=gen) if cross else q
    v = torch.randn(3, 7, 10, generator=gen) if cross else q
    kp = torch.zeros(3, k.shape[1], dtype=torch.bool)
    kp[1, -2:] = True  # torch: True = padding
    g = torch.randn(3, 5, E, generator=gen)

    inputs_ref = [t.clone().requires_grad_() for t in ((q, k, v) if cross else (q,))]
    qr, kr, vr = inputs_ref if cross else inputs_ref * 3
    out_ref = m_ref(qr, kr, vr, key_padding_mask=kp, need_weights=False)[0]
    (out_ref * g).sum().backward()

    inputs_got = [t.clone().requires_grad_() for t in ((q, k, v) if cross else (q,))]
    qg, kg, vg = inputs_got if cross else inputs_got * 3
    out = at.multi_head_attention(
        qg, kg, vg, **torch_masks(key_padding_mask=kp), **_mha_kwargs(m_got)
    )
    assert out.dtype == torch.float32
    assert_close(_np(out), _np(out_ref), F32, "torch adapter MHA")
    (out * g).sum().backward()
    for a, b in zip(inputs_ref, inputs_got, strict=True):
        assert_close(_np(b.grad), _np(a.grad), F32, "torch adapter MHA grad")
    _grads_close(
        list(m_ref.named_parameters()), list(m_got.named_parameters()), "torch adapter MHA grad"
    )


def test_mha_return_weights_and_no_grad():
    m = _mha(8, 2)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        ref, w_ref = m(x, x, x, average_attn_weights=True)
        out, w = at.multi_head_attention(x, return_weights="mean", **_mha_kwargs(m))
    assert not out.requires_grad
    assert_close(_np(out), _np(ref), F32, "torch adapter MHA")
    assert_close(_np(w), _np(w_ref), F32, "torch adapter MHA")
    xg = x.clone().requires_grad_()
    out, w = at.multi_head_attention(xg, return_weights=True, **_mha_kwargs(m))
    assert out.requires_grad and not w.requires_grad
    with torch.inference_mode():
        at.multi_head_attention(x, **_mha_kwargs(m))


# --------------------------------------------------------------------------- SDPA


@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa"])
def test_sdpa_matches_torch(case):
    gen = torch.Generator().manual_seed(2)
    B, h, n_q, n_k, d = 2, 4, 5, 6, 8
    h_kv = 2 if case == "gqa" else h
    q = torch.randn(B, h, n_q, d, generator=gen)
    k = torch.randn(B, h_kv, n_k, d, generator=gen)
    v = torch.randn(B, h_kv, n_k, 3, generator=gen)
    kwargs: dict = {}
    if case == "causal":
        kwargs = dict(is_causal=True)
        ours = dict(causal=True)
    elif case == "bool_mask":
        m = torch.rand(B, 1, n_q, n_k, generator=gen) > 0.4
        m[..., 0] = True  # SDPA's bool masks mean "may attend", as attnlab's
        kwargs = ours = dict(attn_mask=m)
        ours = dict(mask=m)
    elif case == "float_mask":  # a learned bias: its gradient too
        m = torch.randn(n_q, n_k, generator=gen)
        m_ref, m_got = m.clone().requires_grad_(), m.clone().requires_grad_()
        kwargs, ours = dict(attn_mask=m_ref), dict(mask=m_got)
    else:
        ours = {}
    if case == "gqa":
        kwargs = dict(enable_gqa=True)
    leaves_ref = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves_ref, **kwargs)
    out = at.scaled_dot_product_attention(*leaves, **ours)
    assert_close(_np(out), _np(ref), F32, "torch adapter SDPA")
    g = torch.randn(ref.shape, generator=gen)
    (ref * g).sum().backward()
    (out * g).sum().backward()
    for a, b in zip(leaves_ref, leaves, strict=True):
        assert_close(_np(b.grad), _np(a.grad), F32, "torch adapter SDPA grad")
    if case == "float_mask":
        assert_close(_np(m_got.grad), _np(m_ref.grad), F32, "torch adapter SDPA grad mask")


# --------------------------------------------------------------------------- bilinear


def _torch_bilinear(xq, xk, xv, w_qk, u_k, w_v, w_o, b_v, b_o, h, scale):
    """Plain torch: logits_i = scale * (x_q W_i x_k^T + u_i x_k^T)."""
    logits = torch.einsum("bqd,hde,bke->bhqk", xq, w_qk, xk)
    logits = logits + torch.einsum("he,bke->bhk", u_k, xk)[:, :, None, :]
    p = torch.softmax(scale * logits, dim=-1)
    vals = (xv @ w_v + b_v).reshape(xv.shape[0], xv.shape[1], h, -1).transpose(1, 2)
    ctx = (p @ vals).transpose(1, 2).reshape(xq.shape[0], xq.shape[1], -1)
    return ctx @ w_o + b_o


def test_bilinear_matches_plain_torch():
    gen = torch.Generator().manual_seed(3)
    h, d = 2, 8
    xq, xk = torch.randn(2, 4, d, generator=gen), torch.randn(2, 6, d, generator=gen)
    params = dict(
        w_qk=torch.randn(h, d, d, generator=gen) * 0.3,
        u_k=torch.randn(h, d, generator=gen) * 0.3,
        w_v=torch.randn(d, d, generator=gen) * 0.3,
        w_o=torch.randn(d, 5, generator=gen) * 0.3,
        b_v=torch.randn(d, generator=gen),
        b_o=torch.randn(5, generator=gen),
    )
    ref_leaves = {k_: t.clone().requires_grad_() for k_, t in dict(xq=xq, xk=xk, **params).items()}
    got_leaves = {k_: t.clone().requires_grad_() for k_, t in dict(xq=xq, xk=xk, **params).items()}
    r = ref_leaves
    ref = _torch_bilinear(
        r["xq"],
        r["xk"],
        r["xk"],
        r["w_qk"],
        r["u_k"],
        r["w_v"],
        r["w_o"],
        r["b_v"],
        r["b_o"],
        h,
        (d / h) ** -0.5,
    )
    g_ = got_leaves
    out = at.bilinear_attention(
        g_["xq"],
        g_["xk"],
        w_qk=g_["w_qk"],
        u_k=g_["u_k"],
        w_v=g_["w_v"],
        w_o=g_["w_o"],
        b_v=g_["b_v"],
        b_o=g_["b_o"],
        num_heads=h,
    )
    assert_close(_np(out), _np(ref), F32, "torch adapter bilinear")
    gout = torch.randn(ref.shape, generator=gen)
    (ref * gout).sum().backward()
    (out * gout).sum().backward()
    for name in ref_leaves:
        assert_close(
            _np(got_leaves[name].grad),
            _np(ref_leaves[name].grad),
            F32,
            "torch adapter bilinear grad",
        )


def test_bilinear_with_a_bilinearqk_constant():
    rng = np.random.default_rng(4)
    w = [rng.standard_normal((8, 8)).astype(F32) * 0.3 for _ in range(4)]
    qk = attnlab.collapse_qk(w[0], w[1], num_heads=2)
    x = torch.randn(3, 8, requires_grad=True)
    out = at.bilinear_attention(
        x, w_qk=qk, w_v=torch.from_numpy(w[2]), w_o=torch.from_numpy(w[3]), num_heads=2
    )
    ref = attnlab.multi_head_attention(_np(x), w_q=w[0], w_k=w[1], w_v=w[2], w_o=w[3], num_heads=2)
    assert_close(_np(out), ref, F32, "torch adapter bilinear")
    out.sum().backward()
    assert x.grad.shape == x.shape


# --------------------------------------------------------------------------- additive


def _additive_kwargs(m, variant):
    proj = m.Proj if hasattr(m, "Proj") else m.proj
    return dict(
        w_q=m.to_query.weight.t(),
        b_q=m.to_query.bias,
        w_k=m.to_key.weight.t(),
        b_k=m.to_key.bias,
        w_g=m.w_g,
        w_proj=proj.weight.t(),
        b_proj=proj.bias,
        w_final=m.final.weight.t(),
        b_final=m.final.bias,
        variant=variant,
    )


def _check_module(m_ref, fmap_or_x, ours, label):
    m_got = copy.deepcopy(m_ref)
    x_ref = fmap_or_x.clone().requires_grad_()
    x_got = fmap_or_x.clone().requires_grad_()
    ref = m_ref(x_ref)
    out = ours(m_got, x_got)
    assert_close(_np(out), _np(ref), F32, label)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9))
    (ref * g).sum().backward()
    (out * g).sum().backward()
    assert_close(_np(x_got.grad), _np(x_ref.grad), F32, label + " grad")
    _grads_close(list(m_ref.named_parameters()), list(m_got.named_parameters()), label + " grad")


def test_additive_official_module():
    torch.manual_seed(5)
    m = official_swiftformer_module(torch, 12, 8, 2).eval()
    x = torch.randn(2, 30, 12)
    _check_module(
        m,
        x,
        lambda mg, xg: at.additive_attention(xg, **_additive_kwargs(mg, "official")),
        "torch adapter additive",
    )


def test_additive_hugging_face_module():
    transformers = pytest.importorskip("transformers")
    from transformers.models.swiftformer.modeling_swiftformer import (
        SwiftFormerEfficientAdditiveAttention,
    )

    torch.manual_seed(6)
    m = SwiftFormerEfficientAdditiveAttention(transformers.SwiftFormerConfig(), dim=12).eval()
    x = torch.randn(2, 25, 12)
    # w_g has no effect in the Hugging Face computation: torch gives it no gradient at all
    # (None), attnlab a zero one; compare the others.
    m_ref, m_got = m, copy.deepcopy(m)
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = m_ref(x_ref)
    out = at.additive_attention(x_got, **_additive_kwargs(m_got, "hf"))
    assert_close(_np(out), _np(ref), F32, "torch adapter additive")
    (ref * ref).sum().backward()
    (out * out).sum().backward()
    assert_close(_np(x_got.grad), _np(x_ref.grad), F32, "torch adapter additive grad")
    for (name, a), (_, b) in zip(m_ref.named_parameters(), m_got.named_parameters(), strict=True):
        if name == "w_g":
            assert a.grad is None or not a.grad.any()
            assert not b.grad.any()
        else:
            assert_close(_np(b.grad), _np(a.grad), F32, "torch adapter additive grad")


def test_separable_hugging_face_module():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mobilevitv2.modeling_mobilevitv2 import (
        MobileViTV2LinearSelfAttention,
    )

    torch.manual_seed(7)
    m = MobileViTV2LinearSelfAttention(transformers.MobileViTV2Config(), embed_dim=8).eval()
    fmap = torch.randn(2, 8, 4, 9)  # (B, C, P, N)

    def ours(mg, fg):
        qkv, o = mg.qkv_proj.convolution, mg.out_proj.convolution
        out = at.separable_attention(
            fg.permute(0, 2, 3, 1),
            w_qkv=qkv.weight[:, :, 0, 0].t(),
            b_qkv=qkv.bias,
            w_o=o.weight[:, :, 0, 0].t(),
            b_o=o.bias,
        )
        return out.permute(0, 3, 1, 2)

    _check_module(m, fmap, ours, "torch adapter separable")


# --------------------------------------------------------------------------- gradcheck


# gradcheck also runs the backward twice and compares: attnlab's results are bitwise
# reproducible, so no tolerance.
NONDET = 0.0


def _leaves(gen, *shapes, scale=0.5):
    return [
        (torch.randn(s, generator=gen, dtype=torch.float64) * scale).requires_grad_()
        for s in shapes
    ]


def test_gradcheck_mha():
    gen = torch.Generator().manual_seed(10)
    xq, xk, wq, wk, wv, wo, bq, bk, bv, bo = _leaves(
        gen, (2, 3, 4), (2, 5, 3), (4, 4), (3, 4), (3, 4), (4, 5), 4, 4, 4, 5
    )
    kp = torch.tensor([[True] * 5, [True, True, True, False, False]])

    def cross(xq, xk, wq, wk, wv, wo, bq, bk, bv, bo):
        return at.multi_head_attention(
            xq,
            xk,
            w_q=wq,
            w_k=wk,
            w_v=wv,
            w_o=wo,
            b_q=bq,
            b_k=bk,
            b_v=bv,
            b_o=bo,
            num_heads=2,
            key_padding_mask=kp,
        )

    assert torch.autograd.gradcheck(
        cross, (xq, xk, wq, wk, wv, wo, bq, bk, bv, bo), nondet_tol=NONDET
    )
    x, w1, w2, w3, w4 = _leaves(gen, (2, 3, 4), (4, 4), (4, 2), (4, 2), (4, 4))

    def self_gqa(x, w1, w2, w3, w4):  # the same tensor as query, key and value
        return at.multi_head_attention(
            x, x, x, w_q=w1, w_k=w2, w_v=w3, w_o=w4, num_heads=2, num_kv_heads=1, causal=True
        )

    assert torch.autograd.gradcheck(self_gqa, (x, w1, w2, w3, w4), nondet_tol=NONDET)


def test_gradcheck_sdpa():
    gen = torch.Generator().manual_seed(11)
    q, k, v = _leaves(gen, (2, 2, 3, 4), (2, 1, 5, 4), (2, 1, 5, 3), scale=1.0)
    mask = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: at.scaled_dot_product_attention(q, k, v, mask=mask, scale=0.7),
        (q, k, v),
        nondet_tol=NONDET,
    )


def test_gradcheck_float_masks():
    """A float mask that requires grad is differentiated (summed back to its broadcast shape),
    through every function that takes one; one that does not is a constant."""
    gen = torch.Generator().manual_seed(14)
    q, k, v = _leaves(gen, (2, 2, 3, 4), (2, 1, 5, 4), (2, 1, 5, 3), scale=1.0)
    (m_sdpa,) = _leaves(gen, (2, 1, 3, 5), scale=1.0)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: at.scaled_dot_product_attention(q, k, v, mask=m, causal=True),
        (q, k, v, m_sdpa),
        nondet_tol=NONDET,
    )
    x, wq, wk, wv, wo, wqk = _leaves(gen, (2, 3, 4), (4, 4), (4, 4), (4, 4), (4, 5), (2, 4, 4))
    (m_heads,) = _leaves(gen, (2, 3, 3), scale=1.0)  # per head, shared by the batch
    assert torch.autograd.gradcheck(
        lambda x, m, wq: at.multi_head_attention(
            x, w_q=wq, w_k=wk, w_v=wv, w_o=wo, num_heads=2, mask=m
        ),
        (x, m_heads, wq),
        nondet_tol=NONDET,
    )
    assert torch.autograd.gradcheck(
        lambda x, m: at.bilinear_attention(x, w_qk=wqk, w_v=wv, w_o=wo, num_heads=2, mask=m),
        (x, m_heads),
        nondet_tol=NONDET,
    )
    d, r, dr = 8, 4, 2
    w_q, w_kv_a, w_kv_b, w_o, x8 = _leaves(
        gen, (d, 2 * (2 + dr)), (d, r + dr), (r, 2 * (2 + 2)), (2 * 2, d), (2, 3, d)
    )
    (m_lat,) = _leaves(gen, (3, 3), scale=1.0)
    norm = torch.ones(r, dtype=torch.float64)
    lat = dict(w_q=w_q, w_kv_a=w_kv_a, kv_a_norm=norm, w_kv_b=w_kv_b, w_o=w_o, num_heads=2)
    assert torch.autograd.gradcheck(
        lambda x, m: at.latent_attention(x, **lat, rope_theta=1e4, mask=m),
        (x8, m_lat),
        nondet_tol=NONDET,
    )
    const = m_sdpa.detach()  # no requires_grad: a constant, as before
    out = at.scaled_dot_product_attention(q, k, v, mask=const)
    out.sum().backward()
    assert const.grad is None and q.grad is not None


def test_gradcheck_bilinear():
    gen = torch.Generator().manual_seed(12)
    xq, xk, wqk, uk, wv, wo, bv, bo = _leaves(
        gen, (2, 3, 4), (2, 4, 4), (2, 4, 4), (2, 4), (4, 4), (4, 3), 4, 3
    )

    def f(xq, xk, wqk, uk, wv, wo, bv, bo):
        return at.bilinear_attention(
            xq,
            xk,
            w_qk=wqk,
            u_k=uk,
            w_v=wv,
            w_o=wo,
            b_v=bv,
            b_o=bo,
            num_heads=2,
            causal="bottom_right",
        )

    assert torch.autograd.gradcheck(f, (xq, xk, wqk, uk, wv, wo, bv, bo), nondet_tol=NONDET)


@pytest.mark.parametrize("variant", ["official", "hf"])
def test_gradcheck_additive(variant):
    gen = torch.Generator().manual_seed(13)
    x, wq, bq, wk, bk, wg, wp, bp, wf, bf = _leaves(
        gen, (2, 5, 3), (3, 4), 4, (3, 4), 4, (4, 1), (4, 4), 4, (4, 2), 2, scale=1.0
    )

    def f(x, wq, bq, wk, bk, wg, wp, bp, wf, bf):
        return at.additive_attention(
            x,
            w_q=wq,
            b_q=bq,
            w_k=wk,
            b_k=bk,
            w_g=wg,
            w_proj=wp,
            b_proj=bp,
            w_final=wf,
            b_final=bf,
            variant=variant,
        )

    assert torch.autograd.gradcheck(f, (x, wq, bq, wk, bk, wg, wp, bp, wf, bf), nondet_tol=NONDET)


def test_gradcheck_separable():
    gen = torch.Generator().manual_seed(14)
    x, wqkv, bqkv, wo, bo = _leaves(gen, (2, 5, 3), (3, 7), 7, (3, 4), 4, scale=1.0)
    kp = torch.tensor([[True] * 5, [True, False, True, True, False]])

    def f(x, wqkv, bqkv, wo, bo):
        return at.separable_attention(
            x, w_qkv=wqkv, b_qkv=bqkv, w_o=wo, b_o=bo, key_padding_mask=kp
        )

    assert torch.autograd.gradcheck(f, (x, wqkv, bqkv, wo, bo), nondet_tol=NONDET)


# --------------------------------------------------------------------------- errors


def test_errors():
    w = {k: torch.randn(4, 4) for k in ("w_q", "w_k", "w_v", "w_o")}
    x = torch.randn(3, 4)
    floats = r"expected a float32, float64, float16 or bfloat16 tensor, got "
    with pytest.raises(TypeError, match=r"query: " + floats + "torch.int64"):
        at.multi_head_attention(torch.ones(3, 4, dtype=torch.int64), num_heads=2, **w)
    with pytest.raises(TypeError, match=r"w_o: " + floats + "torch.complex64"):
        at.multi_head_attention(x, num_heads=2, **{**w, "w_o": w["w_o"].to(torch.complex64)})
    with pytest.raises(TypeError, match=r"w_q: expected a torch.Tensor, got ndarray"):
        at.multi_head_attention(x, num_heads=2, **{**w, "w_q": np.ones((4, 4))})
    with pytest.raises(TypeError, match="q: expected a CPU tensor, got device meta"):
        at.scaled_dot_product_attention(torch.empty(2, 3, 4, device="meta"), x[None], x[None])
    with pytest.raises(TypeError, match="mask: expected a bool or floating-point tensor"):
        at.scaled_dot_product_attention(
            x[None], x[None], x[None], mask=torch.ones(3, 3, dtype=torch.int32)
        )
    with pytest.raises(TypeError, match="mask: " + floats + "torch.complex64"):
        at.scaled_dot_product_attention(  # differentiated: the inputs' dtypes
            x[None], x[None], x[None], mask=torch.ones(3, 3, dtype=torch.cfloat, requires_grad=True)
        )
    with pytest.raises(ValueError, match="w_q"):  # attnlab's own validation still applies
        at.multi_head_attention(x, num_heads=3, **w)


def test_mixed_dtypes_follow_attnlab_and_grads_keep_input_dtype():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = {k: torch.randn(4, 4, requires_grad=True) for k in ("w_q", "w_k", "w_v", "w_o")}
    out = at.multi_head_attention(x, num_heads=2, **w)
    assert out.dtype == torch.float64
    out.sum().backward()
    assert x.grad.dtype == torch.float64 and w["w_q"].grad.dtype == torch.float32


# --------------------------------------------------------------------------- half precision


def _half_case(family, gen, dt):
    """(function, tensor arguments, constants) of a small call of each family in dtype dt."""

    def t(*shape, scale=0.5):
        return (torch.randn(shape, generator=gen) * scale).to(dt).requires_grad_()

    if family == "sdpa":
        return (
            at.scaled_dot_product_attention,
            dict(q=t(2, 4, 5, 8), k=t(2, 2, 6, 8), v=t(2, 2, 6, 8), mask=t(5, 6)),
            {},
        )
    if family == "mha":
        w = {n: t(16, 16) for n in ("w_q", "w_k", "w_v", "w_o")}
        return (
            at.multi_head_attention,
            dict(query=t(2, 5, 16), **w, b_o=t(16)),
            dict(num_heads=4, causal=True),
        )
    if family == "bilinear":
        return (
            at.bilinear_attention,
            dict(query=t(2, 5, 16), w_qk=t(2, 16, 16, scale=0.2), w_v=t(16, 16), w_o=t(16, 16)),
            dict(num_heads=2),
        )
    if family == "latent":
        w = dict(
            w_q=t(16, 2 * 6),
            w_kv_a=t(16, 4 + 2),
            kv_a_norm=t(4),
            w_kv_b=t(4, 2 * 8),
            w_o=t(2 * 4, 16),
        )
        return at.latent_attention, dict(x=t(2, 5, 16), **w), dict(num_heads=2, rope_theta=1e4)
    if family == "additive":
        w = {n: t(16, 16) for n in ("w_q", "w_k", "w_proj", "w_final")}
        return at.additive_attention, dict(x=t(2, 7, 16), **w, w_g=t(16)), {}
    return at.separable_attention, dict(x=t(2, 7, 16), w_qkv=t(16, 33), w_o=t(16, 16)), {}


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["sdpa", "mha", "bilinear", "latent", "additive", "separable"])
def test_half_tensors_are_the_numpy_half_path(family, dt):
    """float16 and bfloat16 tensors go to attnlab's half-precision kernels as stored: the output
    and every gradient are, bit for bit, attnlab.vjp's on the same half arrays, in the
    tensors' dtype (a learned float mask of that dtype too)."""
    if dt == torch.bfloat16:
        ml_dtypes = pytest.importorskip("ml_dtypes")
    f, tensors, consts = _half_case(family, torch.Generator().manual_seed(20), dt)

    def array(x):
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()

    out = f(**tensors, **consts)
    G = (torch.randn(out.shape, generator=torch.Generator().manual_seed(21))).to(dt)
    out.backward(G)
    arrays = {n: array(x) for n, x in tensors.items()}
    ref, pullback = attnlab.vjp(getattr(attnlab, f.__name__), **arrays, **consts)
    grads = pullback(array(G))
    assert out.dtype == dt and np.array_equal(_bits(array(out)), _bits(ref))
    for name, x in tensors.items():
        assert x.grad.dtype == dt and np.array_equal(_bits(array(x.grad)), _bits(grads[name])), name


def test_bfloat16_tensors_without_ml_dtypes(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes raises ImportError
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"q: a torch.bfloat16 tensor needs the ml_dtypes package"):
        at.scaled_dot_product_attention(x, x, x)
