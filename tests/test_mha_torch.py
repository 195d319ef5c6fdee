"""attnlab against PyTorch: torch.nn.MultiheadAttention (batch_first, eval) with its weights
converted by hand, and torch.nn.functional.scaled_dot_product_attention.

Conversions: torch's Linear stores (out, in), so w = weight.T; in_proj_weight
packs the q, k, v rows; torch's boolean masks mean True = NOT allowed, so they are inverted.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnlab
from conftest import assert_close

torch = pytest.importorskip("torch")

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
DTYPES = [F32, F64]
TORCH_DT = {F32: torch.float32, F64: torch.float64}


def _ids(v):
    return str(v)


def _t(a, dtype):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a).astype(dtype)))


def make_torch_mha(embed_dim, num_heads, dtype, *, kdim=None, vdim=None, bias=True, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(
        embed_dim,
        num_heads,
        bias=bias,
        batch_first=True,
        kdim=kdim,
        vdim=vdim,
        dtype=TORCH_DT[dtype],
    )
    m.eval()
    with torch.no_grad():  # random biases too (torch initialises them to 0)
        for p in m.parameters():
            bound = 1.0 / math.sqrt(p.shape[-1]) if p.ndim == 2 else 1.0 / math.sqrt(embed_dim)
            p.uniform_(-bound, bound)
    return m


def weights_from_torch(m) -> dict[str, np.ndarray]:
    """attnlab keyword arguments (in, out) from an nn.MultiheadAttention."""
    E = m.embed_dim
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    if "in_proj_weight" in sd:
        w = sd["in_proj_weight"]
        out = {"w_q": w[:E].T, "w_k": w[E : 2 * E].T, "w_v": w[2 * E :].T}
    else:
        out = {
            "w_q": sd["q_proj_weight"].T,
            "w_k": sd["k_proj_weight"].T,
            "w_v": sd["v_proj_weight"].T,
        }
    if "in_proj_bias" in sd:
        b = sd["in_proj_bias"]
        out.update(b_q=b[:E], b_k=b[E : 2 * E], b_v=b[2 * E :])
    out["w_o"] = sd["out_proj.weight"].T
    if "out_proj.bias" in sd:
        out["b_o"] = sd["out_proj.bias"]
    return out


def torch_masks(B, h, n_q, n_k, kind, rng):
    """(attnlab mask, attnlab key_padding_mask, torch attn_mask, torch key_padding_mask).

    No query row is fully masked (torch returns NaN there, attnlab 0 by contract).
    """
    if kind == "none":
        return None, None, None, None
    allowed = rng.random((n_q, n_k)) < 0.7
    allowed[:, 0] = True
    kpm = rng.random((B, n_k)) < 0.8
    kpm[:, 0] = True
    if kind == "bool":
        return allowed, None, torch.from_numpy(~allowed), None
    if kind == "float":
        f = rng.standard_normal((n_q, n_k))
        f[~allowed] = -np.inf
        return f, None, torch.from_numpy(f), None
    if kind == "per_head":  # torch: (B * h, n_q, n_k), batch-major
        a = rng.random((B, h, n_q, n_k)) < 0.7
        a[..., 0] = True
        return a, None, torch.from_numpy(~a.reshape(B * h, n_q, n_k)), None
    if kind == "kpm":
        return None, kpm, None, torch.from_numpy(~kpm)
    if kind == "bool+kpm":
        return allowed, kpm, torch.from_numpy(~allowed), torch.from_numpy(~kpm)
    raise AssertionError(kind)


@pytest.mark.parametrize("need_weights", [None, "mean", "heads"], ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "per_head", "kpm", "bool+kpm"])
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (7, 7), (65, 130), (130, 65)], ids=_ids)
def test_nn_multihead_attention(n_q, n_k, mask_kind, dtype, need_weights):
    rng = np.random.default_rng(n_q * 1000 + n_k)
    B, E, h = 2, 24, 4
    m = make_torch_mha(E, h, dtype)
    w = weights_from_torch(m)
    query = rng.standard_normal((B, n_q, E))
    key = rng.standard_normal((B, n_k, E))
    value = rng.standard_normal((B, n_k, E))
    mask, kpm, t_mask, t_kpm = torch_masks(B, h, n_q, n_k, mask_kind, rng)
    if isinstance(mask, np.ndarray) and mask.dtype.kind == "f":
        t_mask = t_mask.to(TORCH_DT[dtype])
        mask = mask.astype(dtype)
    with torch.inference_mode():
        t_out, t_w = m(
            _t(query, dtype),
            _t(key, dtype),
            _t(value, dtype),
            attn_mask=t_mask,
            key_padding_mask=t_kpm,
            need_weights=need_weights is not None,
            average_attn_weights=need_weights == "mean",
        )
    args = [a.astype(dtype) for a in (query, key, value)]
    res = attnlab.multi_head_attention(
        *args,
        **{k: v.astype(dtype) for k, v in w.items()},
        num_heads=h,
        mask=mask,
        key_padding_mask=kpm,
        return_weights=need_weights or False,
    )
    out = res[0] if need_weights else res
    assert_close(out, t_out.numpy(), dtype, "mha vs torch MHA")
    if need_weights:
        assert_close(res[1], t_w.numpy(), dtype, "mha vs torch MHA (weights)")


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("kdim,vdim", [(24, 24), (10, 24), (24, 7), (10, 7), (1, 3)], ids=_ids)
def test_nn_multihead_attention_kdim_vdim(kdim, vdim, bias, dtype):
    rng = np.random.default_rng(kdim * 100 + vdim)
    B, E, h, n_q, n_k = 3, 24, 3, 9, 70
    m = make_torch_mha(E, h, dtype, kdim=kdim, vdim=vdim, bias=bias)
    w = weights_from_torch(m)
    assert ("b_q" in w) == bias
    query = rng.standard_normal((B, n_q, E))
    key = rng.standard_normal((B, n_k, kdim))
    value = rng.standard_normal((B, n_k, vdim))
    with torch.inference_mode():
        t_out, t_w = m(
            _t(query, dtype),
            _t(key, dtype),
            _t(value, dtype),
            need_weights=True,
            average_attn_weights=False,
        )
    out, wts = attnlab.multi_head_attention(
        *[a.astype(dtype) for a in (query, key, value)],
        **{k: v.astype(dtype) for k, v in w.items()},
        num_heads=h,
        return_weights="heads",
    )
    assert_close(out, t_out.numpy(), dtype, "mha vs torch MHA")
    assert_close(wts, t_w.numpy(), dtype, "mha vs torch MHA (weights)")


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("n", [1, 64, 197])
def test_nn_multihead_attention_self_fast_path(n, dtype):
    """Self-attention, need_weights=False (torch may take its fused fast path), causal mask."""
    rng = np.random.default_rng(n)
    B, E, h = 2, 32, 4
    m = make_torch_mha(E, h, dtype)
    w = {k: v.astype(dtype) for k, v in weights_from_torch(m).items()}
    x = rng.standard_normal((B, n, E)).astype(dtype)
    with torch.inference_mode():
        t_out, _ = m(_t(x, dtype), _t(x, dtype), _t(x, dtype), need_weights=False)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(n, dtype=TORCH_DT[dtype])
        t_causal, _ = m(
            _t(x, dtype),
            _t(x, dtype),
            _t(x, dtype),
            attn_mask=causal,
            need_weights=False,
            is_causal=True,
        )
    assert_close(
        attnlab.multi_head_attention(x, **w, num_heads=h), t_out.numpy(), dtype, "mha vs torch MHA"
    )
    assert_close(
        attnlab.multi_head_attention(x, **w, num_heads=h, causal=True),
        t_causal.numpy(),
        dtype,
        "mha vs torch MHA",
    )


def test_batchless_input_matches_torch_unbatched():
    rng = np.random.default_rng(5)
    m = make_torch_mha(16, 2, F64)
    w = weights_from_torch(m)
    x = rng.standard_normal((11, 16))
    with torch.inference_mode():
        t_out, t_w = m(_t(x, F64), _t(x, F64), _t(x, F64), average_attn_weights=True)
    out, wts = attnlab.multi_head_attention(x, **w, num_heads=2, return_weights="mean")
    assert_close(out, t_out.numpy(), F64, "mha vs torch MHA")
    assert_close(wts, t_w.numpy(), F64, "mha vs torch MHA (weights)")


# --------------------------------------------------------------------------------------------
# torch.nn.functional.scaled_dot_product_attention
# --------------------------------------------------------------------------------------------


def _sdpa_torch(q, k, v, dtype, **kw):
    with torch.inference_mode():
        return torch.nn.functional.scaled_dot_product_attention(
            _t(q, dtype), _t(k, dtype), _t(v, dtype), **kw
        ).numpy()


SDPA_SHAPES = [  # (batch, h, h_kv, n_q, n_k, d, d_v)
    ((), 1, 1, 1, 1, 1, 1),
    ((2,), 4, 4, 7, 7, 8, 8),
    ((2,), 4, 4, 65, 130, 16, 8),
    ((2, 3), 2, 2, 130, 65, 8, 4),
    ((1,), 2, 2, 300, 300, 32, 32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("variant", ["plain", "bool", "float", "causal", "scale", "gqa"])
@pytest.mark.parametrize("shape", SDPA_SHAPES, ids=_ids)
def test_functional_sdpa(shape, variant, dtype):
    batch, h, h_kv, n_q, n_k, d, d_v = shape
    rng = np.random.default_rng(n_q + 7 * n_k)
    if variant == "gqa":
        if h % 2:
            pytest.skip("needs an even number of heads")
        h_kv = h // 2
    q = rng.standard_normal(batch + (h, n_q, d))
    k = rng.standard_normal(batch + (h_kv, n_k, d))
    v = rng.standard_normal(batch + (h_kv, n_k, d_v))
    ours_kw: dict = {}
    torch_kw: dict = {}
    if variant == "bool":
        m = rng.random((n_q, n_k)) < 0.6
        m[:, 0] = True
        ours_kw["mask"] = m
        torch_kw["attn_mask"] = torch.from_numpy(m)  # same polarity as attnlab
    elif variant == "float":
        m = rng.standard_normal((h, n_q, n_k))
        m[rng.random(m.shape) < 0.3] = -np.inf
        m[..., 0] = 0.0
        ours_kw["mask"] = m.astype(dtype)
        torch_kw["attn_mask"] = _t(m, dtype)
    elif variant == "causal":
        ours_kw["causal"] = True
        torch_kw["is_causal"] = True
    elif variant == "scale":
        ours_kw["scale"] = torch_kw["scale"] = 0.37
    elif variant == "gqa":
        torch_kw["enable_gqa"] = True
    try:
        expected = _sdpa_torch(q, k, v, dtype, **torch_kw)
    except TypeError as e:  # enable_gqa is torch >= 2.5
        pytest.skip(f"torch does not support {variant}: {e}")
    got = attnlab.scaled_dot_product_attention(*[a.astype(dtype) for a in (q, k, v)], **ours_kw)
    assert_close(got, expected, dtype, "sdpa vs torch SDPA")


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_functional_sdpa_bottom_right_as_mask(dtype):
    """bottom_right equals torch with the explicit bottom-right boolean mask (decode)."""
    rng = np.random.default_rng(3)
    n_q, n_k = 5, 140
    q = rng.standard_normal((2, 4, n_q, 16))
    k = rng.standard_normal((2, 4, n_k, 16))
    v = rng.standard_normal((2, 4, n_k, 16))
    allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
    expected = _sdpa_torch(q, k, v, dtype, attn_mask=torch.from_numpy(allowed))
    got = attnlab.scaled_dot_product_attention(
        *[a.astype(dtype) for a in (q, k, v)], causal="bottom_right"
    )
    assert_close(got, expected, dtype, "sdpa vs torch SDPA")
