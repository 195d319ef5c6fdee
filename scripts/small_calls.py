"""Per-call times of the latency-bound calls of issue 30 ("small calls"), float32, inputs as
``bench --peers`` builds them: the BERT-base layer (B=1, n=128, d=768, 12 heads), a tiny layer
(B=1, n=4, d=8, 2 heads: the fixed cost of a call), single-token decode against 8192, 256 and
16 cached keys (32 heads x 128; 16 keys: the fixed cost of a decode call), and against 256 keys
with grouped-query heads (32 query heads, 8 kv heads).

    python scripts/small_calls.py [CASE ...]
        times the attnlab on PYTHONPATH: per case the minimum over 7 repeats of timeit
    python scripts/small_calls.py --compare A/python B/python [--rounds 3] [CASE ...]
        the same for two trees, each case in its own process, A and B alternately, and the
        minimum per tree over the rounds (the machine may be shared: the alternation and the
        minimum keep other jobs' load out of the comparison as far as they can)

ATTNLAB_NUM_THREADS sets the threads (default: the machine's).
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable
from typing import Any

import ab_compare  # scripts/ab_compare.py (this folder is on sys.path when run)

CASES = ("bert", "tiny", "decode8192", "decode256", "decode16", "decode256gqa")
NUMBER = {
    "bert": 100,
    "tiny": 4000,
    "decode8192": 20,
    "decode256": 500,
    "decode16": 2000,
    "decode256gqa": 1000,
}


def _call(name: str) -> Callable[[], Any]:
    import attnlab
    from attnlab._bench.peers_worker import CASES as PEERS
    from attnlab._bench.peers_worker import Case, inputs

    case = {
        "bert": PEERS["bert"],
        "tiny": Case("tiny", 1, 4, 8, 2),
        "decode8192": PEERS["decode"],
        "decode256": Case("decode 256", 1, 256, 4096, 32, core_only=True, n_q=1),
        "decode16": Case("decode 16", 1, 16, 4096, 32, core_only=True, n_q=1),
        "decode256gqa": Case("decode 256 GQA", 1, 256, 4096, 32, core_only=True, n_q=1, h_kv=8),
    }[name]
    a = inputs(case)
    if case.core_only:
        q, k, v = a["q"], a["k"], a["v"]
        return lambda: attnlab.scaled_dot_product_attention(q, k, v)
    x = a.pop("x")
    return lambda: attnlab.multi_head_attention(x, num_heads=case.h, **a)


def time_case(name: str) -> float:
    """Microseconds per call: the minimum over 7 repeats."""
    f = _call(name)
    f()
    n = NUMBER[name]
    return min(timeit.repeat(f, number=n, repeat=7)) / n * 1e6


if __name__ == "__main__":
    sys.exit(ab_compare.main(__doc__, __file__, CASES, time_case, "us", rounds=3))
