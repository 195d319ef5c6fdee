"""Gradients of additive_attention (both variants) and separable_attention.

Central finite differences in float64 for every argument, torch autograd on a float32 (and, for
the eps corner cases, float64) transcription of each module, bitwise determinism across thread
counts, and the grad_out shape check.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import attnlab
from attnlab import _additive as A
from attnlab import _separable as S

# attnlab/__init__.py re-exports these; import them from their module so that this file does
# not depend on that line.
additive_attention_backward = A.additive_attention_backward
separable_attention_backward = S.separable_attention_backward


def seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


# Largest error seen by each comparison, printed at the end of the module (pytest -s).
MEASURED: dict[str, float] = {}


def _record(key: str, err: float) -> None:
    MEASURED[key] = max(MEASURED.get(key, 0.0), err)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for k, v in sorted(MEASURED.items()):
        print(f"{k}: {v:.3e}")


def additive_args(rng, d_in=4, D=6, d_out=5, biases=True, dtype=np.float64):
    kw = {
        "w_q": rng.standard_normal((d_in, D)) * 0.5,
        "w_k": rng.standard_normal((d_in, D)) * 0.5,
        "w_g": rng.standard_normal(D),
        "w_proj": rng.standard_normal((D, D)) * 0.4,
        "w_final": rng.standard_normal((D, d_out)) * 0.4,
    }
    if biases:
        kw.update(
            b_q=rng.standard_normal(D) * 0.3,
            b_k=rng.standard_normal(D) * 0.3,
            b_proj=rng.standard_normal(D) * 0.3,
            b_final=rng.standard_normal(d_out) * 0.3,
        )
    return {k: v.astype(dtype) for k, v in kw.items()}


def separable_args(rng, d=4, d_out=5, biases=True, dtype=np.float64):
    kw = {
        "w_qkv": rng.standard_normal((d, 1 + 2 * d)) * 0.5,
        "w_o": rng.standard_normal((d, d_out)) * 0.5,
    }
    if biases:
        kw.update(b_qkv=rng.standard_normal(1 + 2 * d) * 0.3, b_o=rng.standard_normal(d_out) * 0.3)
    return {k: v.astype(dtype) for k, v in kw.items()}


def padding(rng, batch, n):
    """A mask with some padded tokens; the first batch element (if batched) fully padded."""
    m = rng.random(batch + (n,)) < 0.7
    m[..., 0] = True
    if batch and n > 1:
        m.reshape(-1, n)[0] = False
    return m


def finite_differences(f, x, kw, go, h=1e-6):
    """d sum(go * f(x, **kw)) / d(every array argument), by central differences."""
    args = {"x": x, **kw}
    grads = {}
    for name, arr in args.items():
        if not isinstance(arr, np.ndarray) or arr.dtype == bool:
            continue
        g = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            old = arr[idx]
            vals = []
            for step in (h, -h):
                arr[idx] = old + step
                call = {k: v for k, v in args.items() if k != "x"}
                vals.append(np.sum(go * f(args["x"], **call)))
            arr[idx] = old
            g[idx] = (vals[0] - vals[1]) / (2 * h)
        grads[name] = g
    return grads


def compare(got, want, key):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        assert got[name].shape == want[name].shape, name
        scale = max(1.0, float(np.max(np.abs(want[name]), initial=0.0)))
        err = float(np.max(np.abs(got[name] - want[name]), initial=0.0)) / scale
        _record(key, err)
        yield name, err


SHAPES = [((), 5), ((2,), 5), ((2, 2), 3), ((), 1), ((3,), 1)]


@pytest.mark.empty_rows
@pytest.mark.parametrize("variant", ["official", "hf"])
@pytest.mark.parametrize("batch,n", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("biases", [True, False])
def test_additive_finite_differences(variant, batch, n, masked, biases):
    rng = np.random.default_rng(seed(variant, batch, n, masked, biases))
    kw = additive_args(rng, biases=biases)
    kw.update(variant=variant, scale=0.7)
    if masked:
        kw["key_padding_mask"] = padding(rng, batch, n)
    x = rng.standard_normal(batch + (n, 4))
    go = rng.standard_normal(batch + (n, 5))
    got = additive_attention_backward(go, x, **kw)
    want = finite_differences(attnlab.additive_attention, x, kw, go)
    if variant == "hf":
        assert not np.any(got["w_g"]), "hf: w_g has no effect, its gradient is zero"
    for name, err in compare(got, want, f"additive {variant} vs finite differences"):
        assert err < 1e-6, (name, err)


@pytest.mark.empty_rows
@pytest.mark.parametrize("batch,n", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("biases", [True, False])
def test_separable_finite_differences(batch, n, masked, biases):
    rng = np.random.default_rng(seed("sep", batch, n, masked, biases))
    kw = separable_args(rng, biases=biases)
    if masked:
        kw["key_padding_mask"] = padding(rng, batch, n)
    x = rng.standard_normal(batch + (n, 4))
    go = rng.standard_normal(batch + (n, 5))
    got = separable_attention_backward(go, x, **kw)
    want = finite_differences(attnlab.separable_attention, x, kw, go)
    for name, err in compare(got, want, "separable vs finite differences"):
        assert err < 1e-6, (name, err)


def test_w_g_column_shape_kept():
    rng = np.random.default_rng(1)
    kw = additive_args(rng)
    kw["w_g"] = kw["w_g"][:, None]
    g = additive_attention_backward(np.ones((7, 5)), rng.standard_normal((7, 4)), **kw)
    assert g["w_g"].shape == (6, 1)


# torch transcriptions of the modules (official SwiftFormer, MobileViT-v2), masks as in attnlab.


def torch_additive(torch, x, p, variant, scale, eps, mask):
    F = torch.nn.functional

    def lin(v, w, b):
        return v @ w + (b if b is not None else 0)

    q = F.normalize(lin(x, p["w_q"], p.get("b_q")), dim=-1, eps=eps)
    k = F.normalize(lin(x, p["w_k"], p.get("b_k")), dim=-1, eps=eps)
    m = torch.ones(q.shape[:-1], dtype=q.dtype) if mask is None else mask.to(q.dtype)
    if variant == "official":
        a = (q @ p["w_g"]) * scale * m  # padded tokens carry no score
        a = F.normalize(a, dim=-1, eps=eps)
    else:
        a = m
    G = (a.unsqueeze(-1) * q).sum(dim=-2, keepdim=True)
    h = lin(G * k, p["w_proj"], p.get("b_proj")) + q
    return lin(h, p["w_final"], p.get("b_final"))


def torch_separable(torch, x, p, mask):
    d = x.shape[-1]
    qkv = x @ p["w_qkv"] + p.get("b_qkv", 0)
    s, k, v = qkv[..., :1], qkv[..., 1 : 1 + d], qkv[..., 1 + d :]
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(-1), float("-inf"))
    c = torch.softmax(s, dim=-2)
    ctx = (c * k).sum(dim=-2, keepdim=True)
    return (torch.relu(v) * ctx) @ p["w_o"] + p.get("b_o", 0)


def torch_grads(torch, fn, x, params, go, **extra):
    tx = torch.tensor(x, requires_grad=True)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    out = fn(torch, tx, tp, **extra)
    (out * torch.tensor(go)).sum().backward()
    # an argument the module does not use (hf's w_g) gets no gradient in torch: zero
    return {
        "x": tx.grad.numpy(),
        **{
            k: np.zeros_like(params[k]) if v.grad is None else v.grad.numpy() for k, v in tp.items()
        },
    }


@pytest.mark.parametrize("variant", ["official", "hf"])
@pytest.mark.parametrize("batch,masked", [((), False), ((3,), False), ((3,), True)])
def test_additive_vs_torch(variant, batch, masked):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    n = 40
    p = additive_args(rng, d_in=8, D=12, d_out=6, dtype=np.float32)
    x = rng.standard_normal(batch + (n, 8)).astype(np.float32)
    go = rng.standard_normal(batch + (n, 6)).astype(np.float32)
    mask = None
    if masked:
        mask = rng.random(batch + (n,)) < 0.7
        mask[..., 0] = True
    got = additive_attention_backward(go, x, **p, variant=variant, scale=0.5, key_padding_mask=mask)
    want = torch_grads(
        torch,
        torch_additive,
        x,
        p,
        go,
        variant=variant,
        scale=0.5,
        eps=1e-12,
        mask=None if mask is None else torch.tensor(mask),
    )
    for name, err in compare(got, want, f"additive {variant} vs torch float32"):
        assert err < 1e-4, (name, err)


@pytest.mark.parametrize("batch,masked", [((), False), ((3,), False), ((3,), True)])
def test_separable_vs_torch(batch, masked):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    n, d = 40, 8
    p = separable_args(rng, d=d, d_out=d, dtype=np.float32)
    x = rng.standard_normal(batch + (n, d)).astype(np.float32)
    go = rng.standard_normal(batch + (n, d)).astype(np.float32)
    mask = None
    if masked:
        mask = rng.random(batch + (n,)) < 0.7
        mask[..., 0] = True
    got = separable_attention_backward(go, x, **p, key_padding_mask=mask)
    want = torch_grads(
        torch, torch_separable, x, p, go, mask=None if mask is None else torch.tensor(mask)
    )
    for name, err in compare(got, want, "separable vs torch float32"):
        assert err < 1e-4, (name, err)


def test_additive_below_eps_matches_torch():
    """Zero-norm Q/K rows and an all-zero score vector: torch treats v / max(||v||, eps) as
    v / eps there (the gradient of max goes to eps)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    n = 6
    p = additive_args(rng, biases=False)
    p["w_g"] = np.zeros(6)  # every score 0: ||s|| = 0 < eps
    x = rng.standard_normal((2, n, 4))
    x[0, 2] = 0.0  # no biases: this token's projections are 0, below eps
    go = rng.standard_normal((2, n, 5))
    got = additive_attention_backward(go, x, **p, scale=0.5, eps=1e-3)
    want = torch_grads(
        torch, torch_additive, x, p, go, variant="official", scale=0.5, eps=1e-3, mask=None
    )
    for name, err in compare(got, want, "additive below eps vs torch float64"):
        assert err < 1e-10, (name, err)


def _with_threads(k, fn):
    old = attnlab.get_num_threads()
    try:
        attnlab.set_num_threads(k)
        return fn()
    finally:
        attnlab.set_num_threads(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("family", ["official", "hf", "separable"])
def test_bitwise_identical_across_threads(dtype, family):
    rng = np.random.default_rng(11)
    n = 700  # several row blocks per batch element
    x = rng.standard_normal((3, n, 16)).astype(dtype)
    go = rng.standard_normal((3, n, 16)).astype(dtype)
    mask = rng.random((3, n)) < 0.8
    if family == "separable":
        p = separable_args(rng, d=16, d_out=16, dtype=dtype)

        def run():
            return separable_attention_backward(go, x, **p, key_padding_mask=mask)
    else:
        p = additive_args(rng, d_in=16, D=32, d_out=16, dtype=dtype)

        def run():
            return additive_attention_backward(go, x, **p, variant=family, key_padding_mask=mask)

    one, two = _with_threads(1, run), _with_threads(2, run)
    assert set(one) == set(two)
    for name in one:
        assert one[name].tobytes() == two[name].tobytes(), name


def test_grad_out_shape_checked():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 5, 4))
    with pytest.raises(ValueError, match="grad_out"):
        additive_attention_backward(np.ones((2, 5, 4)), x, **additive_args(rng))
    with pytest.raises(ValueError, match="grad_out"):
        separable_attention_backward(np.ones((5, 5)), x, **separable_args(rng))


def test_empty_and_featureless():
    rng = np.random.default_rng(13)
    g = additive_attention_backward(np.ones((0, 5)), np.ones((0, 4)), **additive_args(rng))
    assert g["x"].shape == (0, 4) and not np.any(g["w_q"]) and not np.any(g["b_final"])
    p = additive_args(rng, d_in=0)
    g = additive_attention_backward(np.ones((3, 5)), np.ones((3, 0)), **p)
    assert g["x"].shape == (3, 0) and g["w_q"].shape == (0, 6)
    want = finite_differences(attnlab.additive_attention, np.ones((3, 0)), p, np.ones((3, 5)))
    for name, err in compare(g, want, "additive d_in=0 vs finite differences"):
        assert err < 1e-6, (name, err)
    p = separable_args(rng, d=0, d_out=3)
    g = separable_attention_backward(np.ones((2, 3)), np.ones((2, 0)), **p)
    assert np.array_equal(g["b_o"], [2.0, 2.0, 2.0]) and g["x"].shape == (2, 0)


def test_exported():
    assert "additive_attention_backward" in A.__all__
    assert "separable_attention_backward" in S.__all__
