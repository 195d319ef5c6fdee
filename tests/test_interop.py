"""attnlab.interop against the real PyTorch modules.

Each loader converts a real module's state_dict (torch.nn.MultiheadAttention; Hugging Face
transformers' SwiftFormerEfficientAdditiveAttention and MobileViTV2LinearSelfAttention) or that
of a faithful re-implementation written here (lucidrains' vit-pytorch Attention, the official
SwiftFormer EfficientAdditiveAttnetion, timm's and ml-cvnets' variants, which are not installed)
and attnlab must reproduce the module's float32 output (normwise relative error <= 1e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import attnlab
from attnlab.interop import (
    from_mobilevitv2,
    from_swiftformer,
    from_torch_mha,
    from_vit_pytorch,
    torch_masks,
)
from conftest import assert_close
from torch_modules import official_swiftformer_module

F32 = np.float32


# --------------------------------------------------------------------------- masks (no torch)


def test_attnlab_never_imports_torch():
    code = (
        "import sys, attnlab, attnlab.interop, attnlab.layers, attnlab.reference; "
        "sys.exit('torch' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), check=False)
    assert res.returncode == 0


def test_torch_masks_bool_polarity_is_inverted():
    am = np.triu(np.ones((3, 4), dtype=bool), k=1)
    kp = np.array([[False, False, True, False]])
    got = torch_masks(am, kp)
    assert set(got) == {"mask", "key_padding_mask"}
    np.testing.assert_array_equal(got["mask"], ~am)
    np.testing.assert_array_equal(got["key_padding_mask"], ~kp)
    assert torch_masks() == {}
    assert set(torch_masks(key_padding_mask=kp)) == {"key_padding_mask"}


def test_torch_masks_float_and_3d():
    rng = np.random.default_rng(0)
    fm = rng.standard_normal((6, 3, 4)).astype(F32)  # (N * h, L, S) with N = 3, h = 2
    got = torch_masks(fm, num_heads=2)["mask"]
    assert got.shape == (3, 2, 3, 4) and got.dtype == F32
    np.testing.assert_array_equal(got.reshape(6, 3, 4), fm)
    assert torch_masks(fm[:1])["mask"].shape == (1, 3, 4)  # broadcasts over batch and heads
    kpf = np.array([[0.0, -1.0, 0.0, -np.inf]], dtype=F32)
    merged = torch_masks(np.triu(np.ones((3, 4), dtype=bool), k=1), kpf)
    assert set(merged) == {"mask"} and merged["mask"].shape == (1, 1, 3, 4)
    assert merged["mask"][0, 0, 0, 1] == -np.inf and merged["mask"][0, 0, 2, 1] == -1.0


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"attn_mask": np.zeros((6, 3, 4))}, ValueError, "num_heads"),
        ({"attn_mask": np.zeros((6, 3, 4)), "num_heads": 4}, ValueError, "attn_mask"),
        ({"attn_mask": np.zeros((3,))}, ValueError, "attn_mask"),
        ({"attn_mask": np.zeros((3, 4), dtype=np.int64)}, TypeError, "attn_mask"),
        ({"key_padding_mask": np.zeros((2, 3, 4), dtype=bool)}, ValueError, "key_padding_mask"),
        ({"key_padding_mask": np.array(["a"])}, TypeError, "key_padding_mask"),
    ],
)
def test_torch_masks_errors(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        torch_masks(**kwargs)


# --------------------------------------------------------------------------- state dict errors


def _mha_sd(E=8, kdim=None, bias=True, rng=None):
    rng = rng or np.random.default_rng(1)
    if kdim is None:
        sd = {"in_proj_weight": rng.standard_normal((3 * E, E)) / 3}
    else:
        sd = {
            "q_proj_weight": rng.standard_normal((E, E)) / 3,
            "k_proj_weight": rng.standard_normal((E, kdim)) / 3,
            "v_proj_weight": rng.standard_normal((E, kdim)) / 3,
        }
    sd["out_proj.weight"] = rng.standard_normal((E, E)) / 3
    if bias:
        sd["in_proj_bias"] = rng.standard_normal(3 * E)
        sd["out_proj.bias"] = rng.standard_normal(E)
    return sd


def test_from_torch_mha_numpy_layout():
    sd = _mha_sd()
    kw = from_torch_mha(sd, 2)
    assert kw["num_heads"] == 2
    np.testing.assert_array_equal(kw["w_k"], sd["in_proj_weight"][8:16].T)
    np.testing.assert_array_equal(kw["b_v"], sd["in_proj_bias"][16:])
    assert kw["w_q"].flags.c_contiguous and not np.shares_memory(kw["w_q"], sd["in_proj_weight"])
    assert set(from_torch_mha(_mha_sd(bias=False), 2)) == {"w_q", "w_k", "w_v", "w_o", "num_heads"}
    kw = from_torch_mha(_mha_sd(kdim=5), 4)
    assert kw["w_k"].shape == (5, 8) and kw["w_v"].shape == (5, 8)


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda sd: sd.pop("out_proj.weight"), ValueError, "missing key 'out_proj.weight'"),
        (lambda sd: sd.update(extra=np.zeros(2)), ValueError, "unexpected keys.*'extra'"),
        (lambda sd: sd.update(in_proj_bias=np.zeros(5)), ValueError, "in_proj_bias.*(24,)"),
        (lambda sd: sd.update(in_proj_weight=np.zeros((20, 8))), ValueError, "in_proj_weight"),
        (
            lambda sd: sd.update(bias_k=np.zeros((1, 1, 8)), bias_v=np.zeros((1, 1, 8))),
            ValueError,
            "add_bias_kv",
        ),
        (lambda sd: sd.update(q_proj_weight=np.zeros((8, 8))), ValueError, "both"),
        (
            lambda sd: sd.update({"out_proj.weight": np.zeros((8, 8), complex)}),
            TypeError,
            "out_proj.weight",
        ),
    ],
)
def test_from_torch_mha_errors_name_the_key(mutate, exc, words):
    sd = _mha_sd()
    mutate(sd)
    with pytest.raises(exc, match=words):
        from_torch_mha(sd, 2)


def test_from_torch_mha_argument_errors():
    with pytest.raises(ValueError, match=r"num_heads.*divisible"):
        from_torch_mha(_mha_sd(), 3)
    with pytest.raises(ValueError, match="add_zero_attn"):
        from_torch_mha(_mha_sd(), 2, add_zero_attn=True)
    with pytest.raises(TypeError, match="state_dict"):
        from_torch_mha([1, 2], 2)
    with pytest.raises(ValueError, match="not the state_dict"):
        from_torch_mha({"weight": np.zeros(3)}, 2)


class _FakeMHA:
    """Duck-typed stand-in for nn.MultiheadAttention (torch not needed)."""

    def __init__(self, sd, num_heads, add_zero_attn=False):
        self._sd, self.num_heads, self.add_zero_attn = sd, num_heads, add_zero_attn
        self.bias_k = None

    def state_dict(self):
        return self._sd


def test_from_torch_mha_takes_the_module_and_refuses_add_zero_attn():
    sd = _mha_sd()
    kw = from_torch_mha(_FakeMHA(sd, 2))
    ref = from_torch_mha(sd, 2)
    assert kw["num_heads"] == 2 and set(kw) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(kw[k], ref[k])
    assert from_torch_mha(_FakeMHA(sd, 2), 2)["num_heads"] == 2
    with pytest.raises(ValueError, match="num_heads: got 4, but the module has num_heads = 2"):
        from_torch_mha(_FakeMHA(sd, 2), 4)
    with pytest.raises(ValueError, match="add_zero_attn: the module was built with"):
        from_torch_mha(_FakeMHA(sd, 2, add_zero_attn=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        from_torch_mha(_FakeMHA(sd, 2), add_zero_attn=True)
    with pytest.raises(ValueError, match="num_heads: needed with a state_dict"):
        from_torch_mha(sd)


def test_bool_flags_are_checked():
    for bad in (1, "yes", None, np.float64(1.0)):
        with pytest.raises(TypeError, match="add_zero_attn: expected True or False"):
            from_torch_mha(_mha_sd(), 2, add_zero_attn=bad)
    vit = {"to_qkv.weight": np.zeros((24, 8)), "norm.weight": np.ones(8), "norm.bias": np.zeros(8)}
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="ignore_norm: expected True or False"):
            from_vit_pytorch(vit, 2, ignore_norm=bad)
    assert from_vit_pytorch(vit, 2, ignore_norm=np.bool_(True))["num_heads"] == 2


def test_prefix_without_trailing_dot():
    sd = _mha_sd()
    many = {f"enc.{i}.{k}": v * (i + 1) for i in (1, 10) for k, v in sd.items()}
    kw = from_torch_mha(many, 2, prefix="enc.1")  # not also enc.10.*
    np.testing.assert_array_equal(kw["w_o"], sd["out_proj.weight"].T * 2)
    np.testing.assert_array_equal(
        from_torch_mha(many, 2, prefix="enc.10")["w_o"], sd["out_proj.weight"].T * 11
    )
    one = {"self_attn." + k: v for k, v in sd.items() if k != "out_proj.weight"}
    with pytest.raises(ValueError, match=r"missing key 'self_attn\.out_proj\.weight'"):
        from_torch_mha(one, 2, prefix="self_attn")


def test_prefix_found_or_refused():
    sd = _mha_sd()
    one = {"enc.0.attn." + k: v for k, v in sd.items()}
    kw = from_torch_mha(one, 2)
    np.testing.assert_array_equal(kw["w_o"], sd["out_proj.weight"].T)
    two = {**one, **{"enc.1.attn." + k: v for k, v in sd.items()}, "head.weight": np.zeros(2)}
    with pytest.raises(ValueError, match=r"2 torch.nn.MultiheadAttention modules.*prefix="):
        from_torch_mha(two, 2)
    kw1 = from_torch_mha(two, 2, prefix="enc.1.attn.")
    np.testing.assert_array_equal(kw1["w_q"], kw["w_q"])
    with pytest.raises(ValueError, match=r"not part of.*prefix='enc.0.attn.'"):
        from_torch_mha({**one, "head.weight": np.zeros(2)}, 2)
    with pytest.raises(ValueError, match="prefix"):
        from_torch_mha(one, 2, prefix="nope.")


def test_loader_errors_other_families():
    rng = np.random.default_rng(2)
    d = 4
    sf = {
        f"{m}.weight": rng.standard_normal((d, d)) for m in ("to_query", "to_key", "Proj", "final")
    }
    sf["w_g"] = rng.standard_normal((d, 1))
    with pytest.raises(ValueError, match="variant"):
        from_swiftformer(sf, "paper")
    with pytest.raises(ValueError, match="both"):
        from_swiftformer({**sf, "proj.weight": sf["Proj.weight"]})
    with pytest.raises(ValueError, match=r"w_g.*\(4, 1\)"):
        from_swiftformer({**sf, "w_g": np.zeros((3, 1))})
    with pytest.raises(ValueError, match=r"missing key 'to_key.weight'"):
        from_swiftformer({k: v for k, v in sf.items() if k != "to_key.weight"})
    mv = {
        "qkv_proj.weight": rng.standard_normal((2 * d + 1, d, 1, 1)),
        "out_proj.weight": rng.standard_normal((d, d, 1, 1)),
    }
    assert from_mobilevitv2(mv)["w_qkv"].shape == (d, 2 * d + 1)
    with pytest.raises(ValueError, match=r"qkv_proj.weight.*1 \+ 2 d"):
        from_mobilevitv2({**mv, "qkv_proj.weight": np.zeros((2 * d, d, 1, 1))})
    with pytest.raises(ValueError, match="1x1"):
        from_mobilevitv2({**mv, "out_proj.weight": np.zeros((d, d, 3, 3))})
    vit = {
        "to_qkv.weight": rng.standard_normal((3 * d, d)),
        "norm.weight": np.ones(d),
        "norm.bias": np.zeros(d),
    }
    with pytest.raises(ValueError, match=r"LayerNorm.*ignore_norm=True"):
        from_vit_pytorch(vit, 1)
    kw = from_vit_pytorch(vit, 1, ignore_norm=True)
    np.testing.assert_array_equal(kw["w_o"], np.eye(d))
    with pytest.raises(ValueError, match="heads"):
        from_vit_pytorch(vit, 3, ignore_norm=True)


# --------------------------------------------------------------------------- against torch

try:
    import torch
    from torch import nn
except ImportError:  # the comparisons below need torch; the tests above do not
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


def _np(t):
    return t.detach().numpy()


def _seeded_mha(E, h, *, bias=True, batch_first=True, kdim=None, vdim=None):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, h, bias=bias, batch_first=batch_first, kdim=kdim, vdim=vdim)
    with torch.no_grad():  # torch initialises the biases to 0; make them count
        for name, p in m.named_parameters():
            if "bias" in name:
                p.uniform_(-0.3, 0.3)
    return m.eval()


@needs_torch
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_mha_packed(bias, batch_first):
    E, h, B, n = 16, 4, 3, 7
    m = _seeded_mha(E, h, bias=bias, batch_first=batch_first)
    x = torch.randn(B, n, E)
    xin = x if batch_first else x.transpose(0, 1)
    with torch.no_grad():
        ref = m(xin, xin, xin, need_weights=False)[0]
    ref = ref if batch_first else ref.transpose(0, 1)
    kw = from_torch_mha(m.state_dict(), m.num_heads)  # torch tensors accepted as they are
    assert ("b_q" in kw) == bias and ("b_o" in kw) == bias
    got = attnlab.multi_head_attention(_np(x), **kw)
    assert_close(got, _np(ref), F32, "interop torch MHA")


@needs_torch
def test_torch_mha_kdim_vdim_cross_attention():
    E, h, kdim, vdim = 12, 3, 5, 7
    m = _seeded_mha(E, h, kdim=kdim, vdim=vdim)
    assert "in_proj_weight" not in m.state_dict()
    q, k, v = torch.randn(2, 4, E), torch.randn(2, 6, kdim), torch.randn(2, 6, vdim)
    with torch.no_grad():
        ref, w_ref = m(q, k, v, need_weights=True, average_attn_weights=False)
    kw = from_torch_mha({k_: v_.numpy() for k_, v_ in m.state_dict().items()}, h)
    got, w = attnlab.multi_head_attention(_np(q), _np(k), _np(v), return_weights=True, **kw)
    assert_close(got, _np(ref), F32, "interop torch MHA")
    assert_close(w, _np(w_ref), F32, "interop torch MHA")


@needs_torch
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
def test_torch_mha_masks():
    E, h, B, L, S = 16, 4, 2, 5, 6
    m = _seeded_mha(E, h)
    q, kv = torch.randn(B, L, E), torch.randn(B, S, E)
    gen = torch.Generator().manual_seed(3)
    am = torch.rand(L, S, generator=gen) > 0.6
    am[:, 0] = False  # every query keeps key 0: no fully masked row (torch gives NaN there)
    kp = torch.zeros(B, S, dtype=torch.bool)
    kp[0, 4:] = True
    am3 = torch.rand(B * h, L, S, generator=gen) > 0.6
    am3[..., 0] = False
    fm = torch.randn(L, S, generator=gen)
    kpf = torch.where(kp, -1e9, 0.0) + 0.1 * torch.randn(B, S, generator=gen)
    cases = [
        dict(attn_mask=am),
        dict(key_padding_mask=kp),
        dict(attn_mask=am, key_padding_mask=kp),
        dict(attn_mask=am3, key_padding_mask=kp),
        dict(attn_mask=fm, key_padding_mask=kp),
        dict(attn_mask=fm, key_padding_mask=kpf),
        dict(key_padding_mask=kpf),
    ]
    kw = from_torch_mha(m.state_dict(), h)
    for case in cases:
        with torch.no_grad():
            ref = m(q, kv, kv, need_weights=False, **case)[0]
        masks = torch_masks(**case, num_heads=h)
        got = attnlab.multi_head_attention(_np(q), _np(kv), **masks, **kw)
        assert_close(got, _np(ref), F32, "interop torch MHA masked")


@needs_torch
def test_torch_mha_inside_transformer_layer_with_prefix():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = layer.self_attn(x, x, x, need_weights=False)[0]
    with pytest.raises(ValueError, match=r"prefix='self_attn.'"):
        from_torch_mha(layer.state_dict(), 4)
    kw = from_torch_mha(layer.state_dict(), 4, prefix="self_attn.")
    assert_close(attnlab.multi_head_attention(_np(x), **kw), _np(ref), F32, "interop torch MHA")


@needs_torch
def test_torch_mha_module_add_zero_attn_is_refused():
    """A state_dict cannot show add_zero_attn (it changes the output); the module can."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, add_zero_attn=True, batch_first=True).eval()
    with pytest.raises(ValueError, match="add_zero_attn: the module was built with"):
        from_torch_mha(m)
    with pytest.raises(ValueError, match="add_zero_attn"):
        from_torch_mha(m.state_dict(), m.num_heads, add_zero_attn=m.add_zero_attn)
    # the documented limit: a bare state_dict is accepted, and the result differs from torch
    x = torch.randn(1, 4, 8)
    kw = from_torch_mha(m.state_dict(), 2)
    with torch.no_grad():
        ref = m(x, x, x, need_weights=False)[0]
    assert np.abs(attnlab.multi_head_attention(_np(x), **kw) - _np(ref)).max() > 1e-3
    plain = _seeded_mha(8, 2)
    kw = from_torch_mha(plain)
    with torch.no_grad():
        ref = plain(x, x, x, need_weights=False)[0]
    assert_close(attnlab.multi_head_attention(_np(x), **kw), _np(ref), F32, "interop torch MHA")


@needs_torch
def test_bfloat16_tensors_become_float32():
    m = _seeded_mha(8, 2).to(torch.bfloat16)
    kw = from_torch_mha(m.state_dict(), 2)
    assert kw["w_q"].dtype == F32
    np.testing.assert_array_equal(kw["w_q"], m.in_proj_weight[:8].float().detach().numpy().T)


# vit-pytorch (lucidrains) is not installed: its Attention, written out here as in
# vit_pytorch/vit.py (LayerNorm first, to_qkv without bias, to_out = Linear + Dropout unless
# heads == 1 and dim_head == dim).
if torch is not None:

    class VitAttention(nn.Module):
        def __init__(self, dim, heads=8, dim_head=64, dropout=0.0):
            super().__init__()
            inner_dim = dim_head * heads
            project_out = not (heads == 1 and dim_head == dim)
            self.heads = heads
            self.scale = dim_head**-0.5
            self.norm = nn.LayerNorm(dim)
            self.attend = nn.Softmax(dim=-1)
            self.dropout = nn.Dropout(dropout)
            self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
            self.to_out = (
                nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))
                if project_out
                else nn.Identity()
            )

        def forward(self, x):
            x = self.norm(x)
            b, n, _ = x.shape
            q, k, v = (
                t.reshape(b, n, self.heads, -1).transpose(1, 2)
                for t in self.to_qkv(x).chunk(3, dim=-1)
            )
            attn = self.dropout(self.attend(q @ k.transpose(-1, -2) * self.scale))
            out = (attn @ v).transpose(1, 2).reshape(b, n, -1)
            return self.to_out(out)


@needs_torch
@pytest.mark.parametrize("dim, heads, dim_head", [(32, 4, 8), (24, 3, 16), (16, 1, 16)])
def test_vit_pytorch_attention(dim, heads, dim_head):
    torch.manual_seed(1)
    m = VitAttention(dim, heads, dim_head).eval()
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.2, 0.2)
    x = torch.randn(2, 9, dim)
    with torch.no_grad():
        ref = m(x)
        xn = m.norm(x)  # attnlab computes the attention; the LayerNorm is the caller's
    kw = from_vit_pytorch(m.state_dict(), heads, ignore_norm=True)
    if heads == 1 and dim_head == dim:
        assert not any(k.startswith("to_out") for k in m.state_dict())
        assert "b_o" not in kw
    got = attnlab.multi_head_attention(_np(xn), **kw)
    assert_close(got, _np(ref), F32, "interop vit-pytorch")


@needs_torch
def test_vit_pytorch_prefix_in_a_model():
    torch.manual_seed(2)
    layers = nn.ModuleList(
        [nn.ModuleList([VitAttention(16, 2, 8), nn.Linear(16, 16)]) for _ in range(2)]
    )
    sd = {"transformer.layers." + k: v for k, v in layers.state_dict().items()}
    with pytest.raises(ValueError, match="2 vit-pytorch Attention modules"):
        from_vit_pytorch(sd, 2, ignore_norm=True)
    kw = from_vit_pytorch(sd, 2, prefix="transformer.layers.1.0.", ignore_norm=True)
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        ref = layers[1][0](x)
        xn = layers[1][0].norm(x)
    assert_close(attnlab.multi_head_attention(_np(xn), **kw), _np(ref), F32, "interop vit-pytorch")


# timm's EfficientAdditiveAttention: the same computation on (B, C, H, W), with `proj`.
if torch is not None:

    class TimmAdditive(nn.Module):
        def __init__(self, in_dims, token_dim, num_heads=1):
            super().__init__()
            self.scale_factor = token_dim**-0.5
            self.to_query = nn.Linear(in_dims, token_dim * num_heads)
            self.to_key = nn.Linear(in_dims, token_dim * num_heads)
            self.w_g = nn.Parameter(torch.randn(token_dim * num_heads, 1))
            self.proj = nn.Linear(token_dim * num_heads, token_dim * num_heads)
            self.final = nn.Linear(token_dim * num_heads, token_dim)

        def forward(self, x):
            B, _, H, W = x.shape
            x = x.flatten(2).permute(0, 2, 1)
            query = nn.functional.normalize(self.to_query(x), dim=-1)
            key = nn.functional.normalize(self.to_key(x), dim=-1)
            attn = nn.functional.normalize(query @ self.w_g * self.scale_factor, dim=1)
            attn = torch.sum(attn * query, dim=1, keepdim=True)
            out = self.proj(attn * key) + query
            return self.final(out).permute(0, 2, 1).reshape(B, -1, H, W)


@needs_torch
@pytest.mark.parametrize("in_dims, token_dim, num_heads", [(16, 8, 2), (24, 24, 1)])
def test_swiftformer_official(in_dims, token_dim, num_heads):
    torch.manual_seed(3)
    m = official_swiftformer_module(torch, in_dims, token_dim, num_heads).eval()
    x = torch.randn(2, 49, in_dims)
    with torch.no_grad():
        ref = m(x)
    kw = from_swiftformer(m.state_dict(), "official")
    assert kw["variant"] == "official" and kw["w_final"].shape == (token_dim * num_heads, token_dim)
    assert_close(attnlab.additive_attention(_np(x), **kw), _np(ref), F32, "interop SwiftFormer")


@needs_torch
def test_swiftformer_timm_feature_map():
    torch.manual_seed(4)
    C, H, W = 16, 5, 6
    m = TimmAdditive(C, C).eval()
    fmap = torch.randn(2, C, H, W)
    with torch.no_grad():
        ref = m(fmap)
    kw = from_swiftformer(m.state_dict())  # `proj` names, official computation
    x = _np(fmap).reshape(2, C, H * W).transpose(0, 2, 1)
    got = attnlab.additive_attention(x, **kw).transpose(0, 2, 1).reshape(2, C, H, W)
    assert_close(got, _np(ref), F32, "interop SwiftFormer")


@needs_torch
def test_swiftformer_hugging_face():
    transformers = pytest.importorskip("transformers")
    from transformers.models.swiftformer.modeling_swiftformer import (
        SwiftFormerEfficientAdditiveAttention,
    )

    torch.manual_seed(5)
    m = SwiftFormerEfficientAdditiveAttention(transformers.SwiftFormerConfig(), dim=24).eval()
    x = torch.randn(2, 36, 24)
    with torch.no_grad():
        ref = m(x)
    kw = from_swiftformer(m.state_dict(), variant="hf")
    assert_close(attnlab.additive_attention(_np(x), **kw), _np(ref), F32, "interop SwiftFormer")
    official = attnlab.additive_attention(_np(x), **{**kw, "variant": "official"})
    assert np.max(np.abs(official - _np(ref))) > 1e-3  # the variants really differ


# apple/ml-cvnets LinearSelfAttention names its 1x1 convolutions qkv_proj.block.conv and
# out_proj.block.conv (ConvLayer2d); the computation is that of the Hugging Face port.
if torch is not None:

    class _ConvLayer(nn.Module):
        def __init__(self, c_in, c_out):
            super().__init__()
            self.block = nn.Sequential()
            self.block.add_module("conv", nn.Conv2d(c_in, c_out, 1))

        def forward(self, x):
            return self.block(x)

    class CvnetsLinearSelfAttention(nn.Module):
        def __init__(self, embed_dim):
            super().__init__()
            self.qkv_proj = _ConvLayer(embed_dim, 1 + 2 * embed_dim)
            self.out_proj = _ConvLayer(embed_dim, embed_dim)
            self.embed_dim = embed_dim

        def forward(self, x):
            q, k, v = torch.split(self.qkv_proj(x), [1, self.embed_dim, self.embed_dim], dim=1)
            ctx = (k * torch.softmax(q, dim=-1)).sum(dim=-1, keepdim=True)
            return self.out_proj(torch.relu(v) * ctx.expand_as(v))


def _check_mobilevit(m, C, label):
    fmap = torch.randn(2, C, 4, 10)  # (B, C, P, N)
    with torch.no_grad():
        ref = m(fmap)
    kw = from_mobilevitv2(m.state_dict())
    got = attnlab.separable_attention(_np(fmap).transpose(0, 2, 3, 1), **kw)
    assert_close(got.transpose(0, 3, 1, 2), _np(ref), F32, label)


@needs_torch
def test_mobilevitv2_hugging_face():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mobilevitv2.modeling_mobilevitv2 import (
        MobileViTV2LinearSelfAttention,
    )

    torch.manual_seed(6)
    m = MobileViTV2LinearSelfAttention(transformers.MobileViTV2Config(), embed_dim=12).eval()
    _check_mobilevit(m, 12, "interop MobileViT-v2")


@needs_torch
def test_mobilevitv2_cvnets_names():
    torch.manual_seed(7)
    m = CvnetsLinearSelfAttention(10).eval()
    assert "qkv_proj.block.conv.weight" in m.state_dict()
    _check_mobilevit(m, 10, "interop MobileViT-v2")
