"""precision="bf16" on the tile kernels' task shapes: each output element is one chain of float32
sums whatever task computes it, so the answers are bitwise the same whether rows go through a
wide or a narrow GEMM task, whether queries sit in a full or a half attention tile, and for any
thread count. Run on whichever kernel the CPU has (AMX, VDPBF16PS or the emulation)."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab._loader import core
from conftest import make_mha_weights


def _bf16_linear(x, w, b):
    y = np.empty((x.shape[0], w.shape[1]), np.float32)
    core.linear_forward(x, w, b, y, True)
    return y


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_rows_agree_across_task_shapes(threads):
    """Many row blocks (wide column groups; 1000 features: two spans of tile sums, 790
    columns: an edge block) against the same rows few at a time (narrow groups)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((600, 1000)).astype(np.float32)
    w = (rng.standard_normal((1000, 790)) / 30).astype(np.float32)
    b = rng.standard_normal(790).astype(np.float32)
    before = attnlab.get_num_threads()
    try:
        attnlab.set_num_threads(threads)
        whole = _bf16_linear(x, w, b)
        parts = np.concatenate([_bf16_linear(x[i : i + 100], w, b) for i in range(0, 600, 100)])
    finally:
        attnlab.set_num_threads(before)
    np.testing.assert_array_equal(whole, parts)
    assert np.isfinite(whole).all()


@pytest.mark.parametrize("n_q", [197, 69, 32, 33, 80, 81, 208])
def test_sdpa_queries_agree_in_full_and_half_tiles(n_q):
    """The first n_q queries alone (a last block of at most 32 or 16 queries takes a half or a
    quarter of the tiles) against the same queries among 240 (all in full tiles): bitwise equal."""
    rng = np.random.default_rng(n_q)
    q = rng.standard_normal((2, 3, 240, 64)).astype(np.float32)
    k = rng.standard_normal((2, 3, 150, 64)).astype(np.float32)
    v = rng.standard_normal((2, 3, 150, 64)).astype(np.float32)
    full = attnlab.scaled_dot_product_attention(q, k, v, precision="bf16")
    part = attnlab.scaled_dot_product_attention(q[:, :, :n_q], k, v, precision="bf16")
    np.testing.assert_array_equal(part, full[:, :, :n_q])


def test_vit_layer_bitwise_for_any_thread_count():
    """A ViT-B-shaped layer (wide GEMM tasks, a half attention tile) on one and two threads."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 197, 192)).astype(np.float32)
    w = make_mha_weights(rng, 192, 3, 64, dtype=np.float32)
    before = attnlab.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            attnlab.set_num_threads(threads)
            outs.append(attnlab.multi_head_attention(x, num_heads=3, precision="bf16", **w))
    finally:
        attnlab.set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.isfinite(outs[0]).all()
