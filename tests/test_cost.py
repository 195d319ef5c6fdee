"""The cost model of attnlab.cost, checked against the operations the reference performs."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import attnlab
from attnlab import cost
from attnlab.reference import _bilinear as ref_bilinear


class Counter:
    """Replaces reference._bilinear._matmul: counts multiply-adds and notes each product."""

    def __init__(self) -> None:
        self.calls: list[tuple[np.ndarray, np.ndarray, int]] = []

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = a @ b
        k = a.shape[-1]
        self.calls.append((a, b, int(np.asarray(out).size) * k))
        return out

    def total(self, skip_right: np.ndarray | None = None) -> int:
        return sum(m for _, b, m in self.calls if skip_right is None or b is not skip_right)


@pytest.fixture
def counter(monkeypatch):
    c = Counter()
    monkeypatch.setattr(ref_bilinear, "_matmul", c)
    return c


CASES = [
    # batch, n_q, n_k, d, h, h_kv, d_head
    (1, 16, None, 32, 1, 1, 32),  # self, h = 1
    (2, 12, None, 24, 4, 4, 6),  # self, d_head = d / h
    (3, 10, None, 16, 4, 2, 12),  # self, GQA, d_head > d / 2
    (1, 5, 40, 16, 2, 2, 8),  # cross, n_q < n_k
    (2, 50, 3, 16, 2, 1, 8),  # cross, n_q >> n_k: collapsed uses the key order
    (1, 1, 64, 32, 4, 4, 8),  # one query against 64 keys
]


@pytest.mark.parametrize("case", CASES)
def test_flops_match_counted_reference(rng, counter, case):
    b, n_q, n_k, d, h, h_kv, dh = case
    nk = n_q if n_k is None else n_k
    xq = rng.standard_normal((b, n_q, d))
    xk = xq if n_k is None else rng.standard_normal((b, n_k, d))
    w_q = rng.standard_normal((d, h * dh))
    w_k = rng.standard_normal((d, h_kv * dh))
    kw = dict(n_q=n_q, n_k=n_k, d_model=d, num_heads=h, d_head=dh, batch=b, num_kv_heads=h_kv)

    sep = attnlab.attention_cost("separate", **kw)
    ref_bilinear.separate_logits(xq, xk, w_q=w_q, w_k=w_k, num_heads=h, num_kv_heads=h_kv)
    assert sep["flops"] == counter.total()
    # decode against cached keys: the key projection is not redone
    cached = attnlab.attention_cost("separate", cached=True, **kw)
    assert cached["flops"] == counter.total(skip_right=w_k)
    assert sep["params"] == w_q.size + w_k.size

    counter.calls.clear()
    folded = attnlab.collapse_qk(w_q, w_k, num_heads=h, num_kv_heads=h_kv)
    col = attnlab.attention_cost("collapsed", **kw)
    assert col["params"] == folded.w.size
    counts = {}
    for order in ("query", "key"):
        counter.calls.clear()
        ref_bilinear.bilinear_logits(xq, xk, w_qk=folded, order=order)
        counts[order] = counter.total()
    predicted = cost.collapsed_order_flops(n_q=n_q, n_k=nk, d_q=d, d_k=d, num_heads=h, batch=b)
    assert predicted == counts
    assert col["flops"] == min(counts.values())
    assert attnlab.attention_cost("collapsed", cached=True, **kw)["flops"] == counts["query"]
    order = cost.collapsed_order(n_q=n_q, n_k=nk, d_q=d, d_k=d, num_heads=h, batch=b)
    assert counts[order] == min(counts.values())
    plan = attnlab.plan_qk(**kw)
    assert plan == ("collapsed" if col["flops"] < sep["flops"] else "separate")


def test_issue_formulas():
    # per head, self-attention over n tokens (multiply-adds)
    for n, d, h in [(197, 384, 6), (64, 128, 1), (1000, 64, 8), (7, 512, 16)]:
        dh = d // h
        sep = attnlab.attention_cost("separate", n_q=n, d_model=d, num_heads=h)
        col = attnlab.attention_cost("collapsed", n_q=n, d_model=d, num_heads=h)
        assert sep["flops"] == h * (2 * n * d * dh + n * n * dh)
        assert col["flops"] == h * (n * d * d + n * n * d)
        assert sep["params"] == h * 2 * d * dh
        assert col["params"] == h * d * d
        assert sep["bytes"] == 8 * 2 * n * h * dh
        assert col["bytes"] == 8 * (n * h * d + n * d)
    s4 = attnlab.attention_cost("separate", n_q=10, d_model=8, num_heads=2, itemsize=4, batch=3)
    assert s4["bytes"] == 4 * 3 * 2 * 10 * 8
    # decode: one new token against n cached keys
    dec = dict(n_q=1, n_k=4096, d_model=512, num_heads=8, cached=True)
    assert attnlab.attention_cost("separate", **dec)["flops"] == 512 * 512 + 8 * 4096 * 64
    assert attnlab.attention_cost("collapsed", **dec)["flops"] == 8 * (512 * 512 + 4096 * 512)
    assert attnlab.attention_cost("collapsed", **dec)["bytes"] == 8 * (8 * 512 + 4096 * 512)


def test_plan():
    assert attnlab.plan_qk(n_q=197, d_model=384, num_heads=1) == "collapsed"
    for h in (2, 6, 12):
        assert attnlab.plan_qk(n_q=197, d_model=768, num_heads=h) == "separate"
    # d_head between d/2 and d: collapsed below n* = d (2 d_h - d) / (d - d_h), separate above
    d, dh = 128, 96
    n_star = d * (2 * dh - d) // (d - dh)  # 256
    assert attnlab.plan_qk(n_q=n_star // 2, d_model=d, num_heads=2, d_head=dh) == "collapsed"
    assert attnlab.plan_qk(n_q=n_star * 2, d_model=d, num_heads=2, d_head=dh) == "separate"
    assert attnlab.plan_qk(n_q=n_star, d_model=d, num_heads=2, d_head=dh) == "separate"  # tie
    # the collapsed order follows the lengths
    assert cost.collapsed_order(n_q=1000, n_k=10, d_q=64, d_k=64, num_heads=4) == "key"
    assert cost.collapsed_order(n_q=10, n_k=1000, d_q=64, d_k=64, num_heads=4) == "query"
    assert cost.collapsed_order(n_q=100, n_k=100, d_q=64, d_k=64, num_heads=4) == "query"
    assert (
        cost.collapsed_order(n_q=100, n_k=100, d_q=64, d_k=64, num_heads=4, key_bias=True)
        == "query"
    )


def test_errors():
    with pytest.raises(ValueError, match="form"):
        attnlab.attention_cost("folded", n_q=4, d_model=8, num_heads=2)
    with pytest.raises(ValueError, match="d_head"):
        attnlab.attention_cost("separate", n_q=4, d_model=10, num_heads=3)
    with pytest.raises(ValueError, match="n_q"):
        attnlab.attention_cost("separate", n_q=-1, d_model=8, num_heads=2)
    with pytest.raises(TypeError, match="d_model"):
        attnlab.attention_cost("separate", n_q=4, d_model=8.0, num_heads=2)
    with pytest.raises(ValueError, match="num_heads"):
        attnlab.plan_qk(n_q=4, d_model=8, num_heads=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        attnlab.plan_qk(n_q=4, d_model=8, num_heads=4, num_kv_heads=3)
    with pytest.raises(TypeError):
        attnlab.plan_qk(4, d_model=8, num_heads=2)  # keyword-only


def test_doctests():
    res = doctest.testmod(cost)
    assert res.failed == 0 and res.attempted > 0
