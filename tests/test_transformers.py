"""attnlab.interop.from_transformers against the real transformers attention modules, built from
small configs (no network): BERT, RoBERTa, ViT, GPT-2 (self and cross), Llama, Mistral and
Qwen2 (grouped-query heads, rotary embeddings), in float64 (normwise error <= 1e-12) and float32,
with padding masks in the forms transformers passes them (2-D model masks, 4-D additive float and
boolean layer masks).

float32: 2e-7 (the issue's bound), with the conftest metric. That is float32 rounding itself:
each module run in float32 is 1.9e-7 (median) from the same module in float64, and so is attnlab
(test_as_close_to_exact_as_the_module). Two float32 results with independent rounding errors
differ by more than either: attnlab's projections used to start their sums from the bias and
differed from these modules by up to 2.9e-7 (bound 5e-7 then); they now add the bias after the
products, as torch's linear does (at d = 64 the two projections are then bitwise equal on the
development machine, not at d = 384 or 768), and differ by 1.9e-7 at most below. Across 30
random ViT/BERT layers (not in the suite) the difference was 0.96e-7 to 1.54e-7 (median) and
2.02e-7 at most: the bound holds for the inputs below, it is not a guarantee for every input or
every BLAS torch may use."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab.interop import from_transformers, transformers_masks
from conftest import assert_close

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from transformers.models.bert.modeling_bert import BertAttention, BertSelfAttention  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention,
    LlamaRotaryEmbedding,
)
from transformers.models.mistral.modeling_mistral import MistralAttention  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention  # noqa: E402
from transformers.models.roberta.modeling_roberta import RobertaSelfAttention  # noqa: E402
from transformers.models.vit.modeling_vit import ViTAttention  # noqa: E402

TOL = {torch.float32: 2e-7, torch.float64: 1e-12}
NP = {torch.float32: np.float32, torch.float64: np.float64}
B, N, D = 2, 7, 64
# right padding: the second sequence has 4 real tokens (no query row is fully masked)
PAD = np.array([[1] * N, [1] * 4 + [0] * (N - 4)])


def _randomize(m):
    """Trained-looking weights: U(+-1/sqrt(fan_in)) and non-zero biases (HF zeroes them)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 2:
                fan_in = p.shape[0] if type(m).__name__ == "GPT2Attention" else p.shape[1]
                bound = fan_in**-0.5
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
            else:
                p.copy_(torch.rand(p.shape, generator=gen) * 0.6 - 0.3)
    return m.eval()


def _hf_mask(dtype, causal, impl, n_q=N, n_k=N):
    """The 4-D mask transformers gives its layers: additive float (eager) or bool (sdpa)."""
    allowed = np.broadcast_to(PAD[:, None, None, :n_k].astype(bool), (B, 1, n_q, n_k))
    if causal:
        allowed = allowed & np.tril(np.ones((n_q, n_k), bool), n_k - n_q)
    if impl == "sdpa":
        return torch.from_numpy(np.ascontiguousarray(allowed))
    return torch.from_numpy(np.where(allowed, 0.0, torch.finfo(dtype).min)).to(dtype)


def _check(got, ref, dtype, label):
    assert_close(got, ref.detach().numpy(), NP[dtype], label, tol=TOL[dtype])


def _config(cls, impl, **kw):
    cfg = cls(**kw)
    cfg._attn_implementation = impl
    return cfg


IMPLS = ["eager", "sdpa"]
DTYPES = [torch.float32, torch.float64]


def _skip_eager64(impl, dtype, upcasts):
    if impl == "eager" and dtype == torch.float64 and upcasts:
        pytest.skip(
            "this eager attention takes its softmax in float32 even for float64 "
            "modules; the sdpa implementation is checked in float64"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cls", [BertSelfAttention, RobertaSelfAttention])
def test_bert_self_attention(cls, impl, dtype):
    cfg = _config(T.BertConfig, impl, hidden_size=D, num_attention_heads=4)
    m = _randomize(cls(cfg)).to(dtype)
    x = torch.randn(B, N, D, dtype=dtype, generator=torch.Generator().manual_seed(1))
    kw = from_transformers(m)
    assert kw["num_heads"] == 4 and not kw["causal"] and "rope_theta" not in kw
    with torch.no_grad():
        ref = m(x, attention_mask=_hf_mask(dtype, False, impl))[0]
    for masks in (transformers_masks(PAD), transformers_masks(_hf_mask(dtype, False, impl))):
        _check(
            attnlab.multi_head_attention(x.numpy(), **masks, **kw), ref, dtype, "transformers BERT"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bert_attention_needs_ignore_norm(dtype):
    cfg = _config(T.BertConfig, "sdpa", hidden_size=D, num_attention_heads=8)
    m = _randomize(BertAttention(cfg)).to(dtype)
    with pytest.raises(ValueError, match=r"LayerNorm.*ignore_norm=True"):
        from_transformers(m)
    kw = from_transformers(m, ignore_norm=True)
    x = torch.randn(B, N, D, dtype=dtype, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(x, attention_mask=_hf_mask(dtype, False, "sdpa"))[0]
        out = attnlab.multi_head_attention(x.numpy(), **transformers_masks(PAD), **kw)
        full = m.output.LayerNorm(torch.from_numpy(out) + x)  # the residual and norm: ours
    _check(full.numpy(), ref, dtype, "transformers BERT")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qkv_bias", [True, False])
def test_vit_attention(qkv_bias, impl, dtype):
    _skip_eager64(impl, dtype, upcasts=True)
    cfg = _config(T.ViTConfig, impl, hidden_size=D, num_attention_heads=4, qkv_bias=qkv_bias)
    m = _randomize(ViTAttention(cfg)).to(dtype)
    x = torch.randn(B, 10, D, dtype=dtype, generator=torch.Generator().manual_seed(3))
    kw = from_transformers(m)
    assert ("b_q" in kw) == qkv_bias and "b_o" in kw and not kw["causal"]
    with torch.no_grad():
        ref = m(x)[0]
    _check(attnlab.multi_head_attention(x.numpy(), **kw), ref, dtype, "transformers ViT")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layer_scaled", [False, True])
def test_gpt2_attention(layer_scaled, impl, dtype):
    cfg = _config(
        T.GPT2Config, impl, n_embd=D, n_head=4, scale_attn_by_inverse_layer_idx=layer_scaled
    )
    m = _randomize(GPT2Attention(cfg, layer_idx=2)).to(dtype)
    kw = from_transformers(m)
    assert kw["causal"] is True
    assert kw["scale"] == pytest.approx(16**-0.5 / (3 if layer_scaled else 1), rel=1e-15)
    # Conv1D stores (in, out): c_attn's columns are [Q | K | V], used as they are
    np.testing.assert_array_equal(kw["w_k"], m.c_attn.weight.detach().numpy()[:, D : 2 * D])
    x = torch.randn(B, N, D, dtype=dtype, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = m(x, attention_mask=_hf_mask(dtype, True, impl))[0]
    got = attnlab.multi_head_attention(x.numpy(), **transformers_masks(PAD), **kw)
    _check(got, ref, dtype, "transformers GPT-2")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpt2_cross_attention(dtype):
    cfg = _config(T.GPT2Config, "sdpa", n_embd=D, n_head=4)
    m = _randomize(GPT2Attention(cfg, is_cross_attention=True, layer_idx=0)).to(dtype)
    kw = from_transformers(m)
    assert kw["causal"] is False
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, 5, D, dtype=dtype, generator=gen)
    enc = torch.randn(B, N, D, dtype=dtype, generator=gen)
    with torch.no_grad():
        ref = m(
            x,
            encoder_hidden_states=enc,
            encoder_attention_mask=_hf_mask(dtype, False, "sdpa", 5, N),
        )[0]
    got = attnlab.multi_head_attention(x.numpy(), enc.numpy(), **transformers_masks(PAD), **kw)
    _check(got, ref, dtype, "transformers GPT-2")


def _rope_tables(cfg, head_dim, pos, dtype):
    """cos and sin as LlamaRotaryEmbedding computes them, but in float64 (transformers computes
    them in float32 even for a float64 model); the attention module takes them as input."""
    inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    )
    freqs = pos[..., None].double() * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


LLAMA_FAMILY = [
    (LlamaAttention, T.LlamaConfig, dict(attention_bias=True)),
    (LlamaAttention, T.LlamaConfig, dict(num_key_value_heads=1)),
    (MistralAttention, T.MistralConfig, dict(head_dim=32, sliding_window=None)),
    (
        Qwen2Attention,
        T.Qwen2Config,
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "family", LLAMA_FAMILY, ids=lambda f: f[0].__name__ if isinstance(f, tuple) else str(f)
)
def test_llama_family(family, impl, dtype):
    _skip_eager64(impl, dtype, upcasts=True)
    cls, cfg_cls, extra = family
    cfg = _config(
        cfg_cls,
        impl,
        **{"hidden_size": D, "num_attention_heads": 4, "num_key_value_heads": 2, **extra},
    )
    m = _randomize(cls(cfg, layer_idx=0)).to(dtype)
    kw = from_transformers(m)
    assert kw["num_kv_heads"] == cfg.num_key_value_heads and kw["causal"] is True
    assert kw["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert kw["w_k"].shape == (D, cfg.num_key_value_heads * m.head_dim)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(B, N, D, dtype=dtype, generator=gen)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]])  # position_ids
    pe = _rope_tables(cfg, m.head_dim, pos, dtype)
    with torch.no_grad():
        ref = m(x, position_embeddings=pe, attention_mask=_hf_mask(dtype, True, impl))[0]
        ref_nomask = m(
            x[:1],
            position_embeddings=_rope_tables(cfg, m.head_dim, pos[:1], dtype),
            attention_mask=_hf_mask(dtype, True, impl)[:1] if impl == "eager" else None,
        )[0]
    got = attnlab.multi_head_attention(
        x.numpy(), positions=pos.numpy(), **transformers_masks(PAD), **kw
    )
    _check(got, ref, dtype, "transformers Llama family")
    # default positions 0..n-1 and the module's own causal mask (sdpa applies it when given none)
    _check(
        attnlab.multi_head_attention(x.numpy()[:1], **kw),
        ref_nomask,
        dtype,
        "transformers Llama family",
    )


@pytest.mark.parametrize(
    "cls,cfg_cls", [(ViTAttention, T.ViTConfig), (BertSelfAttention, T.BertConfig)]
)
def test_as_close_to_exact_as_the_module(cls, cfg_cls):
    """attnlab in float32 is as close to the exact result (the same module in float64) as the
    module in float32 is: medians over 12 random layers, within 10% (measured 0.98x for ViT,
    0.99x for BERT)."""
    ours, theirs = [], []
    for seed in range(12):
        torch.manual_seed(seed)
        m = _randomize(cls(_config(cfg_cls, "sdpa", hidden_size=D, num_attention_heads=4)))
        gen = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        m64 = cls(m.config).double().eval()
        m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
        x = torch.randn(B, N, D, generator=gen)
        with torch.no_grad():
            exact = m64(x.double())[0].numpy()
            theirs.append(assert_close(m(x)[0].numpy(), exact, np.float32, "module f32", 1e-6))
        ours.append(
            assert_close(
                attnlab.multi_head_attention(x.numpy(), **from_transformers(m)),
                exact,
                np.float32,
                "attnlab f32 vs exact",
                1e-6,
            )
        )
    assert np.median(ours) <= 1.1 * np.median(theirs), (np.median(ours), np.median(theirs))


def test_llama_transformers_float32_rope_tables():
    """transformers computes cos/sin in float32 (angles rounded to float32): against those,
    attnlab (angles in float64) differs by the rounding of the angles, small at small positions
    and growing with them."""
    cfg = _config(
        T.LlamaConfig, "sdpa", hidden_size=D, num_attention_heads=4, num_key_value_heads=2
    )
    m = _randomize(LlamaAttention(cfg, layer_idx=0))
    x = torch.randn(1, N, D, generator=torch.Generator().manual_seed(7))
    kw = from_transformers(m)
    for start, tol in ((0, 2e-7), (4000, 1e-4)):
        pos = torch.arange(start, start + N)[None]
        with torch.no_grad():
            ref = m(x, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))[0]
        got = attnlab.multi_head_attention(x.numpy(), positions=pos.numpy(), **kw)
        assert_close(got, ref.numpy(), np.float32, "transformers Llama, HF float32 rope", tol=tol)


def test_bert_model_masks_as_transformers_builds_them():
    """A whole (tiny) BertModel: the 2-D attention_mask given to the model and the 4-D mask its
    first layer receives both convert to masks that reproduce that layer's attention."""
    cfg = _config(
        T.BertConfig,
        "eager",
        hidden_size=D,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=50,
    )
    model = T.BertModel(cfg).eval()
    att = model.encoder.layer[0].attention.self
    _randomize(att)
    seen = {}

    def hook(_mod, args, kwargs, out):
        seen["x"], seen["mask"], seen["out"] = args[0], kwargs.get("attention_mask"), out[0]

    handle = att.register_forward_hook(hook, with_kwargs=True)
    ids = torch.randint(0, 50, (B, N), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.from_numpy(PAD))
    handle.remove()
    kw = from_transformers(att)
    for masks in (transformers_masks(PAD), transformers_masks(seen["mask"])):
        got = attnlab.multi_head_attention(seen["x"].numpy(), **masks, **kw)
        _check(got, seen["out"], torch.float32, "transformers BERT")


def test_transformers_masks_forms():
    f32min = np.finfo(np.float32).min
    assert transformers_masks(np.array([[1, 0], [1, 1]]))["key_padding_mask"].tolist() == [
        [True, False],
        [True, True],
    ]
    b = np.array([[[[True, False]]]])
    assert transformers_masks(b)["mask"].tolist() == b.tolist()
    add = np.array([[[[0.0, f32min], [-np.inf, 0.0]]]], np.float32)
    assert transformers_masks(add)["mask"].tolist() == [[[[True, False], [False, True]]]]
    alibi = np.array([[[[-0.5, f32min]]]], np.float32)
    got = transformers_masks(alibi)["mask"]
    assert got.dtype == np.float32 and got[0, 0, 0, 0] == -0.5 and got[0, 0, 0, 1] == -np.inf
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        transformers_masks(np.ones((2, 3, 4)))
    with pytest.raises(TypeError, match="attention_mask"):
        transformers_masks(np.array([["a"]]))
    with pytest.raises(TypeError, match="attention_mask: a 4-D mask"):
        transformers_masks(np.ones((1, 1, 2, 2), np.int64))


def test_from_transformers_refuses_what_it_cannot_represent():
    with pytest.raises(
        TypeError, match=r"module: dict is not a transformers attention module.*GPT2Attention"
    ):
        from_transformers({"q_proj.weight": np.zeros((4, 4))})
    with pytest.raises(TypeError, match="ignore_norm"):
        from_transformers(
            BertSelfAttention(T.BertConfig(hidden_size=D, num_attention_heads=4)), ignore_norm=1
        )
    cfg = T.LlamaConfig(
        hidden_size=D,
        num_attention_heads=4,
        rope_parameters={"rope_type": "made-up", "rope_theta": 1e4, "factor": 2.0},
    )
    with pytest.raises(ValueError, match=r"'made-up'.*not reproduced"):
        from_transformers(LlamaAttention(cfg, layer_idx=0))
    cfg = T.LlamaConfig(
        hidden_size=D,
        num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    )
    with pytest.raises(ValueError, match=r"rope_length: .*'dynamic'"):
        from_transformers(LlamaAttention(cfg, layer_idx=0))
    m = LlamaAttention(T.LlamaConfig(hidden_size=D, num_attention_heads=4), layer_idx=0)
    m.q_norm = torch.nn.LayerNorm(16)  # as OLMo-2 normalises the heads (LayerNorm: not ours)
    with pytest.raises(ValueError, match=r"q_norm is a LayerNorm, not an RMSNorm"):
        from_transformers(m)
    m = LlamaAttention(T.LlamaConfig(hidden_size=D, num_attention_heads=4), layer_idx=0)
    m.gate = torch.nn.Linear(4, 4)  # something the attention call does not model
    with pytest.raises(ValueError, match=r"sub-modules.*'gate'"):
        from_transformers(m)
    rel = BertSelfAttention(T.BertConfig(hidden_size=D, num_attention_heads=4))
    rel.distance_embedding = torch.nn.Embedding(5, 16)
    with pytest.raises(ValueError, match="relative position scores"):
        from_transformers(rel)


def test_sliding_window_is_refused_without_window():
    """A sliding window reproduced neither by the kwargs nor by the module's own call (the window
    lives in the model's mask) is refused, naming it: never the silent causal-only result."""
    if not _missing_options(["window"]):
        pytest.skip("multi_head_attention has window=: the window is reproduced, not refused")
    mistral = MistralAttention(
        T.MistralConfig(hidden_size=D, num_attention_heads=4, sliding_window=8), layer_idx=0
    )
    qwen2 = T.Qwen2Config(
        hidden_size=D,
        num_attention_heads=4,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        num_hidden_layers=2,
    )
    for m in (mistral, Qwen2Attention(qwen2, layer_idx=1)):
        with pytest.raises(ValueError, match=r"sliding_window = 8 tokens.*window= option"):
            from_transformers(m)
    from_transformers(Qwen2Attention(qwen2, layer_idx=0))  # a full layer: reproduced


def test_unknown_module_refusal_names_what_it_does():
    class FancyAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = T.Gemma2Config(sliding_window=4, attn_logit_softcapping=30.0)
            self.q_norm = torch.nn.LayerNorm(4)

    with pytest.raises(
        TypeError,
        match=r"FancyAttention is not .*a sliding window \(sliding_window\), soft-capped "
        r"logits \(attn_logit_softcapping\), .*per-head query norm \(q_norm\).*Supported: ",
    ):
        from_transformers(FancyAttention())


def test_settings_not_reproduced_are_refused_naming_them():
    falcon = T.FalconConfig(**{**SMALL, "alibi": True})
    from transformers.models.falcon.modeling_falcon import FalconAttention
    from transformers.models.mpt.modeling_mpt import MptAttention

    with pytest.raises(ValueError, match=r"config.alibi = True .*bfloat16"):
        from_transformers(FalconAttention(falcon, layer_idx=0))
    mpt = T.MptConfig(d_model=64, n_heads=4, attn_config={"clip_qkv": 2.0})
    with pytest.raises(ValueError, match=r"clip_qkv = 2.0 clamps"):
        from_transformers(MptAttention(mpt, layer_idx=0))
    from transformers.models.bloom.modeling_bloom import BloomAttention

    with pytest.raises(ValueError, match=r"x_residual.*ignore_residual=True"):
        from_transformers(BloomAttention(T.BloomConfig(**{**SMALL, "n_head": 4}), layer_idx=0))
    with pytest.raises(TypeError, match="ignore_residual"):
        from_transformers(LlamaAttention(T.LlamaConfig(**SMALL), 0), ignore_residual="yes")


def test_from_transformers_bfloat16_and_copies():
    cfg = T.LlamaConfig(hidden_size=D, num_attention_heads=4)
    m = LlamaAttention(cfg, layer_idx=0)
    kw = from_transformers(m.to(torch.bfloat16))
    assert kw["w_q"].dtype == np.float32
    m = _randomize(LlamaAttention(cfg, layer_idx=0))
    kw = from_transformers(m)
    with torch.no_grad():
        m.q_proj.weight.zero_()
    assert np.abs(kw["w_q"]).max() > 0  # a copy, not a view of the module's tensor


# ---------------------------------------------------------------------------------------------
# Whole (tiny) models of today's families: every attention layer's input and output captured
# inside the model (the sliding window, the ALiBi biases and the causal mask come from the
# model), reproduced by attnlab from the loader's kwargs and the 2-D padding mask alone.

NW = 20  # tokens, longer than the window
WINDOW = 8
# right padding: the second sequence has 15 real tokens (every query row keeps a key)
PAD20 = np.array([[1] * NW, [1] * 15 + [0] * (NW - 15)])
SMALL = dict(
    vocab_size=50,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def _gqa(**kw):
    return {**SMALL, "num_key_value_heads": 2, **kw}


def _family(name):
    """``(config, attention module classes to check, options the loader emits)``."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    }
    table = {
        "Llama": (T.LlamaConfig, _gqa(attention_bias=True), ()),
        "Llama-llama3": (
            T.LlamaConfig,
            _gqa(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            ),
            (),
        ),
        "Llama-linear": (
            T.LlamaConfig,
            _gqa(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0}),
            (),
        ),
        "Mistral": (T.MistralConfig, _gqa(head_dim=32, sliding_window=WINDOW), ("window",)),
        "Mixtral": (
            T.MixtralConfig,
            _gqa(sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1),
            ("window",),
        ),
        "Qwen2": (
            T.Qwen2Config,
            _gqa(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
            ("window",),
        ),
        "Qwen3": (
            T.Qwen3Config,
            _gqa(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
            ("window", "q_norm"),
        ),
        "Qwen3-full": (T.Qwen3Config, _gqa(head_dim=16), ("q_norm",)),
        "Gemma": (T.GemmaConfig, _gqa(head_dim=16), ()),
        "Gemma2": (
            T.Gemma2Config,
            _gqa(
                head_dim=16,
                sliding_window=WINDOW,
                attn_logit_softcapping=5.0,
                query_pre_attn_scalar=20,
            ),
            ("window", "softcap"),
        ),
        "Gemma3": (
            T.Gemma3TextConfig,
            _gqa(
                head_dim=16,
                sliding_window=WINDOW,
                query_pre_attn_scalar=20,
                sliding_window_pattern=2,
            ),
            ("window", "q_norm"),
        ),
        "Gemma3-full": (
            T.Gemma3TextConfig,
            _gqa(head_dim=16, query_pre_attn_scalar=20, sliding_window_pattern=1),
            ("q_norm",),
        ),
        "GptOss": (
            T.GptOssConfig,
            _gqa(
                head_dim=16,
                sliding_window=WINDOW,
                num_local_experts=2,
                num_experts_per_tok=1,
                rope_parameters=yarn,
            ),
            ("window", "sinks"),
        ),
        "Phi3": (
            T.Phi3Config,
            _gqa(
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                    "short_factor": [1.0, 1.5, 2.0, 3.0],
                    "long_factor": [2.0, 3.0, 5.0, 8.0],
                    "original_max_position_embeddings": 16,
                },
                pad_token_id=0,
            ),
            (),
        ),
        "Phi3-sliding": (T.Phi3Config, _gqa(sliding_window=WINDOW, pad_token_id=0), ("window",)),
        "GPTNeoX": (
            T.GPTNeoXConfig,
            {
                **SMALL,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.25,
                },
            },
            (),
        ),
        "Falcon-multi-query": (
            T.FalconConfig,
            {**SMALL, "multi_query": True, "new_decoder_architecture": False, "alibi": False},
            (),
        ),
        "Falcon-grouped": (
            T.FalconConfig,
            {
                **SMALL,
                "new_decoder_architecture": True,
                "num_kv_heads": 2,
                "alibi": False,
                "bias": True,
            },
            (),
        ),
        "Bloom": (T.BloomConfig, {**SMALL, "n_head": 4}, ("alibi_slopes",)),
        "Mpt": (
            T.MptConfig,
            {**SMALL, "n_heads": 4, "d_model": 64, "max_seq_len": 32},
            ("alibi_slopes",),
        ),
    }
    return table[name]


FAMILIES = [
    "Llama",
    "Llama-llama3",
    "Llama-linear",
    "Mistral",
    "Mixtral",
    "Qwen2",
    "Qwen3",
    "Qwen3-full",
    "Gemma",
    "Gemma2",
    "Gemma3",
    "Gemma3-full",
    "GptOss",
    "Phi3",
    "Phi3-sliding",
    "GPTNeoX",
    "Falcon-multi-query",
    "Falcon-grouped",
    "Bloom",
    "Mpt",
]
# transformers refuses sdpa for these (it cannot soft-cap, add sinks or ALiBi there)
EAGER_ONLY = {"Gemma2", "GptOss", "Bloom", "Mpt"}
# these eager attentions take the softmax in float32 even for a float64 model
EAGER_F32_SOFTMAX = {
    "Llama",
    "Llama-llama3",
    "Llama-linear",
    "Mistral",
    "Mixtral",
    "Qwen2",
    "Qwen3",
    "Qwen3-full",
    "Gemma",
    "Gemma2",
    "Gemma3",
    "Phi3",
    "Phi3-sliding",
    "Bloom",
    "Mpt",
}


def _missing_options(needed):
    import inspect

    have = inspect.signature(attnlab.multi_head_attention).parameters
    return [o for o in needed if o not in have]


def _is_attention(mod):
    name = type(mod).__name__
    return name.endswith("Attention") and (
        hasattr(mod, "q_proj")
        or hasattr(mod, "qkv_proj")
        or hasattr(mod, "query_key_value")
        or hasattr(mod, "Wqkv")
    )


def _refusal(mod):
    """The loader's refusal message for ``mod``, or None when it loads."""
    try:
        from_transformers(mod, ignore_residual=True, rope_length=NW)
    except ValueError as exc:
        return str(exc)
    return None


def _far_from_uniform(model, seed):
    """Random weights with query/key projections scaled up (peaked attention), random norms
    and sinks; biases non-zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("q_proj", "k_proj", "qkv_proj", "query_key_value", "Wqkv")):
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 2.5 / p.shape[1] ** 0.5)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(
                    torch.randn(p.shape, generator=gen) * 0.4
                    + (0 if "Gemma" in type(model).__name__ else 1)
                )
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
    return model.eval()


def _run(name, impl, dtype, seed=0):
    cfg_cls, kw, needed = _family(name)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = impl
    if hasattr(cfg, "num_local_experts"):  # the grouped-GEMM experts refuse float64
        cfg._experts_implementation = "eager"
    model = T.AutoModel.from_config(cfg)
    model = _far_from_uniform(model.to(dtype), seed)
    seen = []

    def hook(mod, args, kwargs, out):
        x = kwargs.get("hidden_states", args[0] if args else None)
        seen.append((mod, x, kwargs, args, out[0]))

    atts = [m for m in model.modules() if _is_attention(m)]
    assert len(atts) == cfg.num_hidden_layers if hasattr(cfg, "num_hidden_layers") else atts
    hooks = [m.register_forward_hook(hook, with_kwargs=True) for m in atts]
    ids = torch.randint(1, 50, (B, NW), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.from_numpy(PAD20))
    for h in hooks:
        h.remove()
    return seen, needed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FAMILIES)
def test_family_inside_the_model(name, impl, dtype):
    """Each attention layer (sliding and full) of a tiny model, 20 tokens with a window of 8,
    right padding: attnlab reproduces the layer's output from the loader's kwargs and the 2-D
    padding mask. float32: 2e-5 (relative; transformers' float32 rotary tables); float64: 2e-6
    (the module's rotary tables, and its q/k norms, are computed in float32)."""
    if impl == "sdpa" and name in EAGER_ONLY:
        pytest.skip(f"transformers has no sdpa attention for {name}")
    if impl == "eager" and dtype == torch.float64 and name in EAGER_F32_SOFTMAX:
        pytest.skip("this eager attention takes its softmax in float32 for a float64 model")
    needed = _family(name)[2]
    seen, _ = _run(name, impl, dtype)
    missing = _missing_options(needed)
    if missing:
        # the loader refuses the layers that need the option, naming it
        refused = [_refusal(mod) for mod, *_ in seen]
        for msg in filter(None, refused):
            assert any(f"{o}=" in msg for o in missing), msg
        assert any(refused), "no layer needing the missing option was refused"
        pytest.skip(f"multi_head_attention has no {', '.join(missing)} option yet")
    kinds = set()
    for mod, x, kwargs, args, out in seen:
        kw = from_transformers(mod, ignore_residual=True, rope_length=NW)
        kinds.add("window" in kw)
        got = attnlab.multi_head_attention(x.numpy(), **transformers_masks(PAD20), **kw)
        if type(mod).__name__ == "BloomAttention":  # its output adds the residual
            res = kwargs.get("residual", args[1] if len(args) > 1 else None)
            got = got + res.numpy()
        tol = 2e-5 if dtype == torch.float32 else 2e-6
        assert_close(got, out.numpy(), NP[dtype], f"transformers {name}", tol=tol)
        if "window" in kw:  # the window matters at 20 tokens: without it, far off
            kw.pop("window")
            plain = attnlab.multi_head_attention(x.numpy(), **transformers_masks(PAD20), **kw)
            assert np.abs(plain - got).max() > 1e-2 * np.abs(got).max()
    if "window" in needed:
        assert kinds == {True, False} or name in ("Mistral", "Mixtral", "Phi3-sliding"), kinds


ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1.5e5,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0 + 0.2 * i for i in range(16)],
        "long_factor": [2.0 + 1.5 * i for i in range(16)],
        "original_max_position_embeddings": 64,
    },
    "proportional": {
        "rope_type": "proportional",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "factor": 2.0,
    },
}


@pytest.mark.parametrize("length", [40, 300])
@pytest.mark.parametrize("rope", list(ROPE_TYPES))
def test_rope_types_match_transformers(rope, length):
    """The loader's frequencies and attention factor (float64, computed from the config) are
    transformers' own (ROPE_INIT_FUNCTIONS, float32) to float32 rounding, for every static
    rope_type and the length-dependent ones at a short and a long length."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = ROPE_TYPES[rope]
    cfg = T.LlamaConfig(
        hidden_size=D, num_attention_heads=2, max_position_embeddings=128, rope_parameters=params
    )
    kw = from_transformers(LlamaAttention(cfg, layer_idx=0), rope_length=length)
    kind = params["rope_type"]
    if kind == "default":
        inv, factor = 1.0 / 1e4 ** (torch.arange(0, 32, 2).double() / 32), 1.0
        assert kw["rope_theta"] == 1e4 and "rope_inv_freq" not in kw
        return
    seq = length if kind in ("dynamic", "longrope") else None
    if kind == "dynamic" and length <= cfg.max_position_embeddings:
        seq = None  # transformers keeps the original frequencies up to the trained length
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=seq)
    np.testing.assert_allclose(kw["rope_inv_freq"], inv.double().numpy(), rtol=2e-6, atol=0)
    assert kw.get("rope_scale", 1.0) == pytest.approx(factor, rel=1e-12)
    assert "rope_theta" not in kw


def _with_grad(mod, kw):
    """The loader's arrays as leaf tensors tied to the module's parameters they come from,
    for comparing gradients: (name in kw, tensor, the module's parameter, to-ours map)."""
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
    pairs = []
    for p, lin in names.items():
        pairs.append((f"w_{p}", getattr(mod, lin).weight, lambda g: g.T))
        if getattr(mod, lin).bias is not None:
            pairs.append((f"b_{p}", getattr(mod, lin).bias, lambda g: g))
    pairs.extend((n, getattr(mod, n).weight, lambda g: g) for n in ("q_norm", "k_norm") if n in kw)
    if "sinks" in kw:
        pairs.append(("sinks", mod.sinks, lambda g: g))
    return pairs


GRAD_MODELS = {  # one model of each option: (family, option checked)
    "Mistral": "window",
    "Qwen3": "q_norm",
    "Gemma3": "q_norm",
    "Gemma2": "softcap",
    "GptOss": "sinks",
}


@pytest.mark.parametrize("name", list(GRAD_MODELS) + ["Llama-yarn"])
def test_gradients_match_the_module_autograd(name):
    """float32: gradients through attnlab.torch (input, weights, norms, sinks) match the
    module's own autograd (eager), on each layer of a tiny model, inside the model's mask."""
    import attnlab.torch as at

    if name == "Llama-yarn":
        cfg = T.LlamaConfig(**_gqa(rope_parameters=ROPE_TYPES["yarn"]))
        needed: tuple = ()
    else:
        cfg_cls, kwcfg, needed = _family(name)
        cfg = cfg_cls(**kwcfg)
    missing = _missing_options(needed)
    if missing:
        pytest.skip(f"multi_head_attention has no {', '.join(missing)} option yet")
    cfg._attn_implementation = "eager"
    if hasattr(cfg, "num_local_experts"):
        cfg._experts_implementation = "eager"
    model = _far_from_uniform(T.AutoModel.from_config(cfg), 3)
    seen = {}

    def hook(mod, _args, kwargs):
        # no cache: the module is called again below (the argument is `cache` from
        # transformers 5.24, `past_key_values` before)
        names = [k for k in ("cache", "past_key_values") if k in kwargs] or ["past_key_values"]
        seen.setdefault(mod, {**kwargs, **dict.fromkeys(names)})

    atts = [m for m in model.modules() if _is_attention(m)]
    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in atts]
    ids = torch.randint(1, 50, (B, NW), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        # no cache at all (transformers 5.24 hands the modules one even when the hook drops
        # it): the second call below would append to it
        model(input_ids=ids, attention_mask=torch.from_numpy(PAD20), use_cache=False)
    for h in hooks:
        h.remove()
    G = torch.randn(B, NW, cfg.hidden_size, generator=torch.Generator().manual_seed(10))
    for mod, kwargs in seen.items():
        kw = from_transformers(mod, rope_length=NW)
        x = kwargs["hidden_states"].detach().clone().requires_grad_(True)
        out = mod(**{**kwargs, "hidden_states": x})[0]
        params = _with_grad(mod, kw)
        theirs = torch.autograd.grad((out * G).sum(), [x] + [p for _, p, _ in params])
        leaves = {n: torch.tensor(kw[n], requires_grad=True) for n, _, _ in params}
        xa = x.detach().clone().requires_grad_(True)
        consts = {k: v for k, v in kw.items() if k not in leaves}
        ours_out = at.multi_head_attention(xa, **transformers_masks(PAD20), **consts, **leaves)
        ours = torch.autograd.grad((ours_out * G).sum(), [xa, *leaves.values()])
        assert_close(ours_out.detach().numpy(), out.detach().numpy(), np.float32, name, 2e-5)
        assert_close(ours[0].numpy(), theirs[0].numpy(), np.float32, f"{name} grad x", 2e-5)
        for (n, _, to_ours), a, b in zip(params, ours[1:], theirs[1:], strict=True):
            assert_close(a.numpy(), to_ours(b).numpy(), np.float32, f"{name} grad {n}", 2e-5)


def test_t5_position_bias_table_trains_through_attnlab_torch():
    """T5's bias computed by the module (compute_bias, a differentiable tensor) and given to
    attnlab.torch as a float mask that requires grad: the table's gradient, and x's, are those of
    the module's own backward."""
    from transformers.models.t5.modeling_t5 import T5Attention

    import attnlab.torch as at

    cfg = T.T5Config(
        vocab_size=50, d_model=32, d_kv=8, num_heads=4, d_ff=16, num_layers=2,
        relative_attention_num_buckets=32, relative_attention_max_distance=64,
    )  # fmt: skip
    att = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).eval()
    _randomize(att)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(B, N, 32, generator=gen, requires_grad=True)
    G = torch.randn(B, N, 32, generator=gen)
    table = att.relative_attention_bias.weight
    out = att(x)[0]
    theirs = torch.autograd.grad((out * G).sum(), [x, table])
    xa = x.detach().clone().requires_grad_(True)
    bias = att.compute_bias(N, N)[0]  # (h, N, N), from the table
    w = {f"w_{p}": getattr(att, p).weight.t() for p in "qkvo"}
    ours_out = at.multi_head_attention(xa, num_heads=4, scale=1.0, mask=bias, **w)
    ours = torch.autograd.grad((ours_out * G).sum(), [xa, table])
    assert_close(ours_out.detach().numpy(), out.detach().numpy(), np.float32, "T5 out", 2e-5)
    assert_close(ours[0].numpy(), theirs[0].numpy(), np.float32, "T5 grad x", 2e-5)
    assert_close(ours[1].numpy(), theirs[1].numpy(), np.float32, "T5 grad table", 2e-5)
    assert theirs[1].abs().sum() > 0  # the table is trained, not left at zero


@pytest.mark.parametrize("decoder", [False, True])
def test_t5_position_bias_is_the_modules(decoder):
    """The bias equals the module's compute_bias bucket for bucket (float32 bucketing, far
    distances past max_distance, decoder offsets), and with it attnlab reproduces the first
    encoder (or decoder) self-attention layer of a tiny T5 inside the model."""
    from transformers.models.t5.modeling_t5 import T5Attention

    from attnlab.interop import t5_position_bias

    cfg = T.T5Config(
        vocab_size=50,
        d_model=32,
        d_kv=8,
        num_heads=4,
        d_ff=16,
        num_layers=2,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=64,
        is_decoder=decoder,
    )
    m = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0)
    with torch.no_grad():
        m.relative_attention_bias.weight.copy_(torch.randn(32, 4))
    for n_q, n_k, off in ((7, 7, 0), (300, 300, 0), (1, 200, 199), (5, 260, 100)):
        with torch.no_grad():
            ref = m.compute_bias(n_q, n_k, past_seen_tokens=off)[0].numpy()
        np.testing.assert_array_equal(t5_position_bias(m, n_q, n_k, query_offset=off), ref)
    with pytest.raises(ValueError, match="T5Attention adds a relative position bias"):
        from_transformers(m)
    with pytest.raises(ValueError, match="no relative_attention_bias table"):
        t5_position_bias(T5Attention(cfg, has_relative_attention_bias=False), 3)
    model = (T.T5EncoderModel if not decoder else T.T5Model)(cfg).eval()
    _randomize(model)
    stack = model.encoder if not decoder else model.decoder
    att = stack.block[0].layer[0].SelfAttention
    seen = {}

    def hook(_mod, args, kwargs, out):
        seen["x"], seen["out"] = kwargs.get("hidden_states", args[0] if args else None), out[0]

    handle = att.register_forward_hook(hook, with_kwargs=True)
    ids = torch.randint(0, 50, (B, N), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        if decoder:
            model(
                input_ids=ids, decoder_input_ids=ids, decoder_attention_mask=torch.from_numpy(PAD)
            )
        else:
            model(input_ids=ids, attention_mask=torch.from_numpy(PAD))
    handle.remove()
    w = {f"w_{p}": getattr(att, p).weight.detach().numpy().T for p in "qkvo"}
    got = attnlab.multi_head_attention(
        seen["x"].numpy(),
        num_heads=4,
        scale=1.0,
        causal=decoder,
        mask=t5_position_bias(att, N),
        **transformers_masks(PAD),
        **w,
    )
    assert_close(got, seen["out"].numpy(), np.float32, "transformers T5", 2e-5)
