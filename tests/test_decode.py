"""The decode path of the attention forward (few query rows per kv head, n_q * h / h_kv <= 16,
against any number of keys, split along the keys and merged by log-sum-exp): against the float64
reference (and torch where installed) with every mask and option, long and short caches, float16
and bfloat16 caches, NaN/Inf rules, thread-count independence, and the backward built on its
lse."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import attnlab
from attnlab import reference
from attnlab._bench.accuracy import FORWARD_C, UNIT_ROUNDOFF, error_bound, logit_scale
from conftest import BF16, assert_close

CASES = [
    # (B, h, h_kv, n_q, n_k, d, d_v, options)
    (1, 4, 4, 1, 3000, 64, 48, {}),
    (2, 8, 2, 1, 2000, 128, 128, {"causal": "bottom_right"}),
    (1, 8, 2, 4, 1500, 64, 32, {"causal": "bottom_right", "window": (700, 0)}),
    (
        2,
        4,
        1,
        2,
        1200,
        33,
        17,
        {"softcap": 2.0, "sinks": [0.3, -1, 2, 0], "alibi_slopes": [1e-3, 2e-3, 4e-3, 8e-3]},
    ),
    (1, 2, 2, 3, 1100, 16, 16, {"mask": "bool"}),
    (1, 2, 1, 5, 1024, 8, 8, {"mask": "float", "causal": True}),
    (3, 16, 1, 1, 4100, 64, 64, {"window": (100, None), "causal": "bottom_right"}),
    # one row against wide value rows: whole register chunks of every variant and a tail
    (1, 2, 2, 1, 2100, 64, 264, {"causal": "bottom_right"}),
]


# Short caches: the key counts around the blocks and splits of the path (one key, a key block
# of 16 or 64 and one more, a split of 256 or 512 keys), each with every option set below.
SHORT_KEYS = (1, 2, 15, 16, 17, 255, 256, 1023)
SHORT_OPTIONS = [
    # (B, h, h_kv, n_q, d, d_v, options): one query row per kv head, grouped-query heads, the
    # 16 rows of the path's limit, widths that are no whole number of vector packets
    (1, 4, 4, 1, 64, 48, {}),
    (2, 8, 2, 2, 128, 128, {"causal": "bottom_right"}),
    (1, 8, 2, 4, 32, 32, {"causal": "bottom_right", "window": (7, 0)}),
    (
        1,
        4,
        1,
        2,
        33,
        17,
        {"softcap": 2.0, "sinks": [0.3, -1, 2, 0], "alibi_slopes": [1e-3, 2e-3, 4e-1, 8e-3]},
    ),
    (1, 2, 2, 3, 16, 16, {"mask": "bool", "causal": True}),
    (1, 2, 1, 5, 8, 8, {"mask": "float", "window": (None, 3)}),
]
SHORT_CASES = [
    (B, h, h_kv, n_q, n_k, d, d_v, opts)
    for n_k in SHORT_KEYS
    for (B, h, h_kv, n_q, d, d_v, opts) in SHORT_OPTIONS
]


def _args(case, dtype, rng):
    B, h, h_kv, n_q, n_k, d, d_v, opts = case
    q = rng.standard_normal((B, h, n_q, d)).astype(dtype)
    k = rng.standard_normal((B, h_kv, n_k, d)).astype(dtype)
    v = rng.standard_normal((B, h_kv, n_k, d_v)).astype(dtype)
    kw = dict(opts, warn_empty_rows=False)  # short caches leave some rows without a key
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((n_q, n_k)) < 0.5
    elif kw.get("mask") == "float":
        kw["mask"] = rng.standard_normal((h, n_q, n_k)).astype(dtype)
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES + SHORT_CASES)
def test_decode_matches_reference(case, dtype):
    rng = np.random.default_rng(1)
    q, k, v, kw = _args(case, dtype, rng)
    out, lse = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, dtype, "decode")
    assert_close(lse, rlse, dtype, "decode lse")
    # the weights path (never the decode path) agrees
    out_w, _ = attnlab.scaled_dot_product_attention(q, k, v, return_weights=True, **kw)
    assert_close(out_w, ref, dtype, "decode vs weights path")


def test_short_decode_matches_torch():
    """One query against short caches, grouped-query heads, the last query aligned with the
    last key (a boolean mask for torch, whose causal mask is top-left)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(5)
    for n_k in SHORT_KEYS:
        for h_kv, n_q in ((8, 1), (2, 3)):
            q = rng.standard_normal((2, 8, n_q, 64)).astype(np.float32)
            k = rng.standard_normal((2, h_kv, n_k, 64)).astype(np.float32)
            v = rng.standard_normal((2, h_kv, n_k, 64)).astype(np.float32)
            out = attnlab.scaled_dot_product_attention(
                q, k, v, causal="bottom_right", warn_empty_rows=False
            )
            seen = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
            ref = F.scaled_dot_product_attention(
                *(torch.from_numpy(x) for x in (q, k, v)),
                attn_mask=torch.from_numpy(seen),
                enable_gqa=True,
            ).numpy()
            ref[..., ~seen.any(1), :] = 0  # a row with no key: torch gives NaN, attnlab 0
            assert_close(out, ref, np.float32, "short decode vs torch")


HALF = [np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("n_k", SHORT_KEYS + (2048,))
def test_decode_reads_half_precision_caches(n_k, dtype):
    """q, k and v stored in float16 or bfloat16: the path widens K and V block by block and
    rounds the result once, within TOL of the float64 result of the stored inputs."""
    rng = np.random.default_rng(6)
    for opts in SHORT_OPTIONS[1:4]:
        B, h, h_kv, n_q, d, d_v, kw = opts
        q, k, v, kw = _args((B, h, h_kv, n_q, n_k, d, d_v, kw), np.float32, rng)
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        out, lse = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        wide = (x.astype(np.float64) for x in (q, k, v))
        ref, rlse = reference.scaled_dot_product_attention(*wide, return_lse=True, **kw)
        assert_close(out, ref, dtype, "half decode")
        assert_close(lse, rlse, np.float32, "half decode lse")  # kept in float32


@pytest.mark.parametrize("lengths", [(1500, 700, 64, 1), (1, 2000, 129, 640)])
def test_padded_batch_decode_reads_no_padding(lengths):
    """A batch of caches of different lengths, padded to one n_k with NaN and Inf (keys and
    values) and a boolean or additive (-inf) mask: each element equals the float64 reference
    on its own keys, and no padding reaches it (key blocks past a length are not read)."""
    rng = np.random.default_rng(12)
    B, h, h_kv, n_k, d = len(lengths), 8, 2, 2000, 64
    q = rng.standard_normal((B, h, 1, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, h_kv, n_k, d)).astype(np.float32) for _ in range(2))
    pad = np.arange(n_k)[None, :] < np.array(lengths)[:, None]
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.inf
        v[b, :, n:] = np.nan
    additive = np.where(pad, np.float32(0), np.float32(-np.inf))
    for mask in (pad, additive):  # False or -inf past each length
        out = attnlab.scaled_dot_product_attention(q, k, v, mask=mask[:, None, None, :])
        assert np.isfinite(out).all()
        for b, n in enumerate(lengths):
            ref = reference.scaled_dot_product_attention(
                *(x[b : b + 1].astype(np.float64) for x in (q, k[:, :, :n], v[:, :, :n]))
            )
            assert_close(out[b : b + 1], ref, np.float32, f"padded element {b}")


@pytest.mark.parametrize("dtype", [np.dtype(np.float32)] + HALF, ids=str)
@pytest.mark.parametrize("d", [128, 72, 8])
@pytest.mark.parametrize("group", [2, 3, 4])
def test_decode_rows_get_the_same_bits_however_grouped(group, d, dtype):
    """A query head decoded with its group (2 to 4 rows a kv head: with AVX-512, four rows' scores
    of 4 keys summed 16 at a time by shuffles, other blocks one sum at a time) and alone (1 row
    a kv head) gives the same bits: every sum adds the same lanes in the same order (the same kv
    heads, so the same splits of the keys)."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 2 * group, 1, d)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 1500, d)).astype(dtype) for _ in range(2))
    for causal in (False, "bottom_right"):
        grouped = attnlab.scaled_dot_product_attention(q, k, v, causal=causal)
        for j in range(group):
            heads = [j, group + j]
            alone = attnlab.scaled_dot_product_attention(q[:, heads], k, v, causal=causal)
            np.testing.assert_array_equal(alone, grouped[:, heads], err_msg=f"head {j}")


@pytest.mark.parametrize("n_k", SHORT_KEYS)
def test_short_decode_bf16_products_within_bound(n_k):
    """precision="bf16" with few query rows per kv head takes the decode path (the AMX tile ran
    short caches before): within the normwise bound test_half holds every bf16 path to."""
    rng = np.random.default_rng(7)
    for opts in SHORT_OPTIONS[:3]:
        B, h, h_kv, n_q, d, d_v, kw = opts
        q, k, v, kw = _args((B, h, h_kv, n_q, n_k, d, d_v, kw), np.float32, rng)
        out = attnlab.scaled_dot_product_attention(q, k, v, precision="bf16", **kw)
        ref = reference.scaled_dot_product_attention(
            *(x.astype(np.float64) for x in (q, k, v)), **kw
        )
        err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)
        bound = error_bound(
            UNIT_ROUNDOFF["bfloat16"], logit_scale(q, k), max(n_k, d, d_v), FORWARD_C
        )
        assert out.dtype == np.float32 and err <= bound, (opts, err, bound)


# Writes every output of the short cases (and a long one of one kv head, many splits) for the
# thread count of its process, then compared bitwise across processes.
_THREADS_SCRIPT = """
import sys
import numpy as np
import attnlab
from test_decode import HALF, SHORT_CASES, _args

outs = {}
for c, case in enumerate(SHORT_CASES + [(1, 4, 1, 2, 3000, 64, 64, {"causal": "bottom_right"})]):
    for dtype in [np.float32, np.float64] + HALF:
        q, k, v, kw = _args(case, np.float32, np.random.default_rng(c))
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        out, lse = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        outs[f"{c} {np.dtype(dtype)} out"] = out.view(np.uint8)
        outs[f"{c} {np.dtype(dtype)} lse"] = lse.view(np.uint8)
np.savez(sys.argv[1], **outs)
"""


def test_decode_bitwise_independent_of_thread_count_in_processes(tmp_path):
    """Each thread count in its own process (ATTNLAB_NUM_THREADS): the split of the keys
    depends on the shapes only, so every output and lse is the same to the bit."""
    import attnlab as pkg

    here = Path(__file__).resolve().parent
    root = str(Path(pkg.__file__).resolve().parents[1])
    script = tmp_path / "outs.py"
    script.write_text(textwrap.dedent(_THREADS_SCRIPT))
    runs = []
    for n in (1, 2, 3):
        env = dict(os.environ, ATTNLAB_NUM_THREADS=str(n))
        env["PYTHONPATH"] = os.pathsep.join(
            x for x in (str(here), root, env.get("PYTHONPATH")) if x
        )
        dest = tmp_path / f"threads{n}.npz"
        r = subprocess.run(
            [sys.executable, str(script), str(dest)],
            env=env,
            cwd=here,
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs.append(dict(np.load(dest)))
    assert len(runs[0]) == 2 * (len(SHORT_CASES) + 1) * (2 + len(HALF))
    for other in runs[1:]:
        assert other.keys() == runs[0].keys()
        for name, a in runs[0].items():
            np.testing.assert_array_equal(other[name], a, err_msg=name)


def test_decode_bitwise_independent_of_thread_count():
    rng = np.random.default_rng(2)
    q, k, v, kw = _args(CASES[1], np.float32, rng)
    outs = []
    prev = attnlab.get_num_threads()
    try:
        for n in (1, 2, 3):
            attnlab.set_num_threads(n)
            outs.append(attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw))
    finally:
        attnlab.set_num_threads(prev)
    for o in outs[1:]:
        np.testing.assert_array_equal(o[0], outs[0][0])
        np.testing.assert_array_equal(o[1], outs[0][1])


@pytest.mark.parametrize("n_k", [17, 256, 2048])
def test_decode_nonfinite_rules(n_k):
    """NaN in a value row a query may not see never reaches it; NaN in q makes its row NaN;
    Inf in a visible value row reaches that row; rows with no key are 0 with lse -inf."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 2, 16))
    k = rng.standard_normal((1, 1, n_k, 16))
    v = rng.standard_normal((1, 1, n_k, 16))
    v[0, 0, n_k - 1, 3] = np.nan  # seen by the last query only (bottom_right)
    out = attnlab.scaled_dot_product_attention(q, k, v, causal="bottom_right")
    assert np.all(np.isfinite(out[..., 0, :]))
    assert np.isnan(out[..., 1, 3]).all() and np.isfinite(np.delete(out[..., 1, :], 3, -1)).all()
    q2 = q.copy()
    q2[0, 1, 0, 0] = np.nan
    v2 = v.copy()
    v2[0, 0, n_k - 1, 3] = 0.0
    out = attnlab.scaled_dot_product_attention(q2, k, v2)
    assert np.isnan(out[0, 1, 0]).all() and np.isfinite(out[0, 0]).all()
    v3 = v2.copy()
    v3[0, 0, 4, 2] = np.inf  # seen by both queries
    out = attnlab.scaled_dot_product_attention(q, k, v3, causal="bottom_right")
    assert np.isposinf(out[..., 2]).all() and np.isfinite(np.delete(out, 2, -1)).all()
    mask = np.zeros((2, n_k), bool)
    mask[1, 5] = True
    out, lse = attnlab.scaled_dot_product_attention(
        q, k, v, mask=mask, return_lse=True, warn_empty_rows=False
    )
    assert np.all(out[..., 0, :] == 0) and np.all(np.isneginf(lse[..., 0]))
    np.testing.assert_allclose(out[..., 1, :], v[0, 0, 5].reshape(1, 1, -1).repeat(2, 1))


@pytest.mark.parametrize("case", [CASES[3], SHORT_OPTIONS[3][:4] + (17,) + SHORT_OPTIONS[3][4:]])
def test_decode_gradients_and_vjp(case):
    rng = np.random.default_rng(4)
    q, k, v, kw = _args(case, np.float64, rng)
    g = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    grads = attnlab.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    _, pull = attnlab.vjp(attnlab.scaled_dot_product_attention, q, k, v, **kw)
    kept = pull(g)
    for name in grads:
        np.testing.assert_allclose(kept[name], grads[name], rtol=1e-12, atol=1e-13)
    # q's gradient against central differences of the reference along one direction
    direction = rng.standard_normal(q.shape)
    eps = 1e-6

    def loss(x):
        return float(np.sum(reference.scaled_dot_product_attention(x, k, v, **kw) * g))

    num = (loss(q + eps * direction) - loss(q - eps * direction)) / (2 * eps)
    assert abs(num - float(np.sum(grads["q"] * direction))) < 1e-6 * max(1.0, abs(num))


def test_build_info_names_the_decode_prefetch():
    """The decode path requests the rows it streams into L2 on every CPU (AMD and Intel alike;
    the results would be the same with any level: a prefetch changes no arithmetic)."""
    assert attnlab.build_info()["decode_prefetch"].startswith("l2:")
