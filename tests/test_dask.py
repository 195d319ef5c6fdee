"""attnlab.dask on a dask.distributed cluster of 2 worker processes: batch-, query- and
key-chunked attention against the one-machine call (float64 to 1e-12, float32 to 1e-6), the
options that depend on absolute positions, masks, key padding, grouped-query heads, key blocks
that no query may see, the weights sent once, the workers' kernel threads, and a key-chunked
call whose keys and values are 4x a worker's memory limit."""

from __future__ import annotations

import resource

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import attnlab  # noqa: E402
import attnlab.dask as ad  # noqa: E402

MEMORY_LIMIT = 400 * 2**20  # bytes per worker


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit=MEMORY_LIMIT,
            dashboard_address=":0",
            silence_logs=40,
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


TOL = {np.float64: 1e-12, np.float32: 1e-6}


def close(got, want, dtype):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == np.dtype(dtype)
    both_inf = np.isneginf(got) & np.isneginf(want)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both rows saw no key
        err = np.abs(np.where(both_inf, 0, got - want)).max(initial=0.0)
    assert err <= TOL[dtype] * max(1.0, np.abs(np.where(both_inf, 0, want)).max(initial=0.0))


def qkv(rng, dtype, b=3, h=4, h_kv=2, n_q=37, n_k=53, d=8, d_v=5):
    return (
        rng.standard_normal((b, h, n_q, d)).astype(dtype),
        rng.standard_normal((b, h_kv, n_k, d)).astype(dtype),
        rng.standard_normal((b, h_kv, n_k, d_v)).astype(dtype),
    )


# (batch, query, key) chunk sizes: whole sequences by batch, queries split, keys split, both
CHUNKS = [(1, 37, 53), (3, 10, 53), (2, 37, 11), (2, 9, 7)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_sdpa_blocks_match_one_machine(client, dtype, causal):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, dtype)
    kw = dict(causal=causal, window=(9, 4) if causal else None)
    want, want_lse = attnlab.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    results = []
    for cb, cq, ck in CHUNKS:
        out, lse = ad.scaled_dot_product_attention(
            da.from_array(q, chunks=(cb, 4, cq, 8)),
            da.from_array(k, chunks=(cb, 2, ck, 8)),
            da.from_array(v, chunks=(cb, 2, ck, 5)),
            return_lse=True,
            **kw,
        )
        assert out.chunks[0] == da.from_array(q, chunks=(cb, 4, cq, 8)).chunks[0]
        results.append((out, lse))
    for out, lse in client.compute(results, sync=True):
        close(out, want, dtype)
        close(lse, want_lse, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sdpa_masks_and_position_options(client, dtype):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, dtype)
    bool_mask = rng.random((3, 1, 37, 53)) > 0.3
    float_mask = rng.standard_normal((37, 53)).astype(dtype)
    cases = [
        dict(mask=bool_mask, causal="bottom_right"),
        dict(mask=float_mask, causal=True, alibi_slopes=rng.random(4), softcap=2.5),
        dict(window=(3, 2), sinks=rng.standard_normal(4), alibi_slopes=rng.random((3, 4))),
    ]
    todo, wants = [], []
    for kw in cases:
        wants.append(attnlab.scaled_dot_product_attention(q, k, v, warn_empty_rows=False, **kw))
        mkw = dict(kw)
        if "mask" in kw:
            mkw["mask"] = da.from_array(kw["mask"], chunks=(1, 1, 12, 20)[-kw["mask"].ndim :])
        todo.append(
            ad.scaled_dot_product_attention(
                da.from_array(q, chunks=(2, 4, 12, 8)),
                da.from_array(k, chunks=(2, 2, 20, 8)),
                v,
                **mkw,
            )
        )
    for got, want in zip(client.compute(todo, sync=True), wants, strict=True):
        close(got, want, dtype)


def mha_weights(rng, dtype, d_q=12, d_k=10, h=4, h_kv=2, d_head=6, d_vhead=5, d_out=7):
    w = dict(
        w_q=rng.standard_normal((d_q, h * d_head)) * 0.3,
        w_k=rng.standard_normal((d_k, h_kv * d_head)) * 0.3,
        w_v=rng.standard_normal((d_k, h_kv * d_vhead)) * 0.3,
        w_o=rng.standard_normal((h * d_vhead, d_out)) * 0.3,
        b_q=rng.standard_normal(h * d_head),
        b_k=rng.standard_normal(h_kv * d_head),
        b_v=rng.standard_normal(h_kv * d_vhead),
        b_o=rng.standard_normal(d_out),
    )
    return {n: a.astype(dtype) for n, a in w.items()}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_mha_blocks_match_one_machine(client, dtype, causal):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 37, 12)).astype(dtype)
    y = rng.standard_normal((3, 53, 10)).astype(dtype)
    kp = rng.random((3, 53)) > 0.2
    kp[1, 14:40] = False  # a whole key block padded: its rows are all masked
    mask = rng.random((37, 53)) > 0.2
    w = mha_weights(rng, dtype)
    kw = dict(w, num_heads=4, num_kv_heads=2, causal=causal, key_padding_mask=kp, mask=mask)
    want, want_lse = attnlab.multi_head_attention(
        x, y, return_lse=True, warn_empty_rows=False, **kw
    )
    todo = []
    for cb, cq, ck in CHUNKS:
        dkw = dict(kw, key_padding_mask=da.from_array(kp, chunks=(cb, ck)))
        todo.append(
            ad.multi_head_attention(
                da.from_array(x, chunks=(cb, cq, 12)),
                da.from_array(y, chunks=(cb, ck, 10)),
                return_lse=True,
                **dkw,
            )
        )
    for out, lse in client.compute(todo, sync=True):
        close(out, want, dtype)
        close(lse, want_lse, dtype)


try:
    import ml_dtypes

    HALVES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
except ImportError:  # bfloat16 has no NumPy name without it
    HALVES = [np.dtype(np.float16)]


def bits_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("half", HALVES, ids=lambda d: d.name)
def test_half_precision_is_sent_as_stored_and_rounded_once(client, half):
    """q, k, v (and multi-head inputs and weights) of one half dtype are sent as stored (no
    conversion in the graph) and the result is stored in that dtype: bit for bit the same
    graph on the widened float32 arrays, rounded once (so one block is the one-machine half
    call); float32 queries against a half-precision cache give the float32 graph's bits."""
    rng = np.random.default_rng(9)
    q, k, v = (a.astype(half) for a in qkv(rng, np.float32))
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    todo = []
    for cb, cq, ck in CHUNKS:
        chunks = ((cb, 4, cq, 8), (cb, 2, ck, 8), (cb, 2, ck, 5))
        got = ad.scaled_dot_product_attention(
            *(da.from_array(a, chunks=c) for a, c in zip((q, k, v), chunks, strict=True)),
            causal=True,
            return_lse=True,
        )
        assert got[0].dtype == half and not any("astype" in n for n in got[0].dask.layers)
        ref = ad.scaled_dot_product_attention(
            *(da.from_array(a, chunks=c) for a, c in zip((q32, k32, v32), chunks, strict=True)),
            causal=True,
            return_lse=True,
        )
        mixed = ad.scaled_dot_product_attention(
            da.from_array(q32, chunks=chunks[0]),
            *(da.from_array(a, chunks=c) for a, c in zip((k, v), chunks[1:], strict=True)),
            causal=True,
        )
        todo.append((*got, *ref, mixed))
    results = client.compute(todo, sync=True)
    for out, lse, ref, ref_lse, mixed in results:
        assert bits_equal(out, ref.astype(half)) and bits_equal(lse, ref_lse)
        assert bits_equal(mixed, ref)
    whole = attnlab.scaled_dot_product_attention(q, k, v, causal=True)
    assert bits_equal(results[0][0], whole)  # CHUNKS[0]: whole sequences, one call a block
    x = rng.standard_normal((3, 37, 12)).astype(half)
    y = rng.standard_normal((3, 53, 10)).astype(half)
    w = {n: a.astype(half) for n, a in mha_weights(rng, np.float32).items()}
    w32 = {n: a.astype(np.float32) for n, a in w.items()}
    kw = dict(num_heads=4, num_kv_heads=2, causal=True)
    todo = []
    for cb, cq, ck in CHUNKS:
        for xs, ws in (((x, y), w), ((x.astype(np.float32), y.astype(np.float32)), w32)):
            todo.append(
                ad.multi_head_attention(
                    da.from_array(xs[0], chunks=(cb, cq, 12)),
                    da.from_array(xs[1], chunks=(cb, ck, 10)),
                    **ws,
                    **kw,
                )
            )
    results = client.compute(todo, sync=True)
    for got, ref in zip(results[::2], results[1::2], strict=True):
        assert bits_equal(got, ref.astype(half))
    assert bits_equal(results[0], attnlab.multi_head_attention(x, y, **w, **kw))


@pytest.mark.usefixtures("client")
def test_mha_self_attention_rope_norms_sinks():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 45, 12))
    w = mha_weights(rng, np.float64, d_k=12)
    kw = dict(
        w,
        num_heads=4,
        num_kv_heads=2,
        causal=True,
        rope_theta=500.0,
        q_norm=rng.random(6) + 0.5,
        k_norm=rng.random(6) + 0.5,
        sinks=rng.standard_normal(4),
        alibi_slopes=rng.random(4),
        window=(20, None),
    )
    want = attnlab.multi_head_attention(x, **kw)
    got = ad.multi_head_attention(da.from_array(x, chunks=(1, 10, 12)), **kw)
    close(got.compute(), want, np.float64)
    positions = rng.permutation(100)[:45]
    want = attnlab.multi_head_attention(x, positions=positions, **kw)
    got = ad.multi_head_attention(da.from_array(x, chunks=(2, 16, 12)), positions=positions, **kw)
    close(got.compute(), want, np.float64)


def test_hidden_key_blocks_are_skipped_and_empty_rows_are_zero(client):
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, np.float64, b=1, n_q=8, n_k=40)
    # causal, top-left: queries 0..7 see keys 0..7 only; the key blocks from 10 on are skipped
    got = ad.scaled_dot_product_attention(q, da.from_array(k, chunks=(1, 2, 10, 8)), v, causal=True)
    parts = [key for key in got.dask if isinstance(key, tuple) and "-part" in key[0]]
    assert len(parts) == 1
    close(got.compute(), attnlab.scaled_dot_product_attention(q, k, v, causal=True), np.float64)
    # a mask that leaves query rows 0-2 with no key at all: output 0, lse -inf
    mask = np.ones((8, 40), bool)
    mask[:3] = False
    out, lse = ad.scaled_dot_product_attention(
        q, da.from_array(k, chunks=(1, 2, 10, 8)), v, mask=mask, return_lse=True
    )
    out, lse = client.compute([out, lse], sync=True)
    assert np.all(out[..., :3, :] == 0) and np.all(np.isneginf(lse[..., :3]))
    want = attnlab.scaled_dot_product_attention(q, k, v, mask=mask, warn_empty_rows=False)
    close(out, want, np.float64)


@pytest.mark.usefixtures("client")
def test_weights_are_one_graph_value():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 32, 12))
    w = mha_weights(rng, np.float64, d_k=12)
    w.update(num_heads=4, num_kv_heads=2)
    out = ad.multi_head_attention(da.from_array(x, chunks=(1, 8, 12)), **w)
    graph = dict(out.__dask_graph__())
    holders = [key for key, val in graph.items() if isinstance(val, ad._Params)]
    assert len(holders) == 1
    users = [key for key in graph if isinstance(key, tuple) and key[0].endswith(("-q", "-kv"))]
    assert len(users) == 4 * 4 * 2  # queries and keys of 4 batch x 4 token blocks
    close(out.compute(), attnlab.multi_head_attention(x, **w), np.float64)


def test_workers_run_one_kernel_thread_per_task_thread(client):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, np.float64, b=4)
    ad.scaled_dot_product_attention(da.from_array(q, chunks=(1, 4, 37, 8)), k, v).compute()
    threads = client.run(attnlab.get_num_threads)
    nthreads = client.nthreads()
    assert threads == {addr: nthreads[addr] for addr in threads} == dict.fromkeys(threads, 1)


@pytest.mark.usefixtures("client")
def test_errors_name_the_argument():
    q = da.zeros((2, 4, 8, 8), chunks=(1, 4, 8, 8))
    with pytest.raises(ValueError, match="k: expected last dimension d = 8"):
        ad.scaled_dot_product_attention(q, da.zeros((2, 4, 8, 6)), da.zeros((2, 4, 8, 6)))
    with pytest.raises(ValueError, match="mask: shape"):
        ad.scaled_dot_product_attention(q, q, q, mask=np.ones((3, 8), bool))
    with pytest.raises(ValueError, match="split_every"):
        ad.scaled_dot_product_attention(q, q, q, split_every=1)
    with pytest.raises(TypeError, match="q: expected real floating-point data"):
        ad.scaled_dot_product_attention(q.astype(complex), q, q)
    x = da.zeros((2, 8, 12))
    with pytest.raises(ValueError, match="num_kv_heads"):
        ad.multi_head_attention(
            x,
            **mha_weights(np.random.default_rng(0), np.float64, d_k=12),
            num_heads=4,
            num_kv_heads=3,
        )


def _peak_rss() -> int:
    """This process's peak resident memory, bytes: VmHWM, the high-water mark of its own
    address space. Not ru_maxrss: a process forked and exec'd keeps its parent's maxrss from
    before the exec (a worker spawned by a pytest process holding 900 MB reported 900 MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _random_block(block_info=None, ones=False):
    """One block of keys or values, made on the worker; values end with a feature of ones."""
    info = block_info[None]
    rng = np.random.default_rng([info["chunk-location"][2], int(ones)])
    x = rng.standard_normal(info["chunk-shape"], dtype=np.float32)
    if ones:
        x[..., -1] = 1.0
    return x


def test_keys_and_values_of_4x_a_workers_memory_complete(client):
    """Keys and values generated block by block on the workers (never whole anywhere), 4x a
    worker's memory limit together; each worker's peak resident memory stays under the limit.
    The last value feature is 1, so that feature of every output row is exactly the sum of the
    softmax weights merged over all key blocks: 1."""
    h, d, n_q = 2, 64, 8
    block = 2**16  # keys per block: 32 MiB of keys and values in float32
    n_k = (4 * MEMORY_LIMIT) // (2 * h * d * 4)
    n_k -= n_k % block
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, h, n_q, d)).astype(np.float32)
    blocks = ((1,), (h,), (block,) * (n_k // block), (d,))
    k = da.map_blocks(_random_block, dtype=np.float32, chunks=blocks, ones=False)
    v = da.map_blocks(_random_block, dtype=np.float32, chunks=blocks, ones=True)
    assert k.nbytes + v.nbytes >= 4 * MEMORY_LIMIT
    out, lse = ad.scaled_dot_product_attention(q, k, v, return_lse=True, split_every=8)
    out, lse = client.compute([out, lse], sync=True)
    np.testing.assert_allclose(out[..., -1], 1.0, rtol=1e-5)
    assert np.all(np.isfinite(lse)) and np.all(np.isfinite(out))
    peaks = client.run(_peak_rss)
    assert max(peaks.values()) < MEMORY_LIMIT, peaks
