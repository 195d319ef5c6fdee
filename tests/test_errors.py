"""Every error path of scaled_dot_product_attention and multi_head_attention: the exception type
(ValueError or TypeError) and a message naming the argument (docs/architecture.md, section 3).

Each case is a valid call with one thing broken. A last test replays every case in a fresh
process, so a crash (rather than an exception) is reported as a failure, not a dead test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnlab

D, H = 8, 2


def _mha_base() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s) * 0.3  # noqa: E731
    return dict(
        query=w(2, 5, D),
        key=w(2, 6, D),
        value=w(2, 6, D),
        w_q=w(D, D),
        w_k=w(D, D),
        w_v=w(D, D),
        w_o=w(D, D),
        b_q=w(D),
        b_k=w(D),
        b_v=w(D),
        b_o=w(D),
        num_heads=H,
    )


def _sdpa_base() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return dict(
        q=rng.standard_normal((2, 4, 5, 8)),
        k=rng.standard_normal((2, 2, 6, 8)),
        v=rng.standard_normal((2, 2, 6, 3)),
    )


def _mha(**change: Any) -> Callable[[], Any]:
    def call() -> Any:
        kw = _mha_base()
        kw.update(change)
        kw = {k: v for k, v in kw.items() if v is not _DROP}
        q, k, v = kw.pop("query"), kw.pop("key", None), kw.pop("value", None)
        return attnlab.multi_head_attention(q, k, v, **kw)

    return call


def _sdpa(**change: Any) -> Callable[[], Any]:
    def call() -> Any:
        kw = _sdpa_base()
        kw.update(change)
        q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
        return attnlab.scaled_dot_product_attention(q, k, v, **kw)

    return call


_DROP = object()
E = np.empty
C = lambda *s: np.ones(s, dtype=complex)  # noqa: E731
VE, TE = ValueError, TypeError

# (id, call, exception type, regex the message must match: the argument's name)
CASES: list[tuple[str, Callable[[], Any], type, str]] = [
    # ---------------- multi_head_attention: ranks
    ("mha-query-1d", _mha(query=E(D)), VE, "query"),
    ("mha-query-0d", _mha(query=1.0), VE, "query"),
    ("mha-key-1d", _mha(key=E(D)), VE, "key"),
    ("mha-value-1d", _mha(value=E(D)), VE, "value"),
    ("mha-w_q-1d", _mha(w_q=E(D)), VE, "w_q"),
    ("mha-w_q-3d", _mha(w_q=E((1, D, D))), VE, "w_q"),
    ("mha-w_k-1d", _mha(w_k=E(D)), VE, "w_k"),
    ("mha-w_v-3d", _mha(w_v=E((1, D, D))), VE, "w_v"),
    ("mha-w_o-1d", _mha(w_o=E(D)), VE, "w_o"),
    # ---------------- widths
    ("mha-query-width", _mha(query=E((2, 5, D + 1))), VE, "w_q|query"),
    ("mha-key-width", _mha(key=E((2, 6, D + 1))), VE, "w_k|key"),
    ("mha-value-width", _mha(value=E((2, 6, D + 1))), VE, "w_v|value"),
    ("mha-w_k-cols", _mha(w_k=E((D, D - 2))), VE, "w_k"),
    ("mha-w_k-rows", _mha(w_k=E((D + 1, D))), VE, "w_k"),
    ("mha-w_v-cols-not-heads", _mha(w_v=E((D, 7))), VE, "w_v"),
    ("mha-w_o-rows", _mha(w_o=E((D - 2, D))), VE, "w_o"),
    ("mha-w_q-zero-width", _mha(w_q=E((D, 0))), VE, "w_q"),
    ("mha-w_v-zero-width", _mha(w_v=E((D, 0)), w_o=E((0, D)), b_v=_DROP), VE, "w_v"),
    # ---------------- token counts
    ("mha-value-tokens", _mha(value=E((2, 7, D))), VE, "value"),
    ("mha-value-tokens-default-key", _mha(key=None, value=E((2, 4, D))), VE, "value"),
    # ---------------- heads
    ("mha-heads-do-not-divide-w_q", _mha(num_heads=3), VE, "w_q|num_heads"),
    ("mha-kv-heads-not-divisor", _mha(num_heads=4, num_kv_heads=3), VE, "num_kv_heads"),
    ("mha-kv-heads-more-than-heads", _mha(num_kv_heads=4), VE, "num_kv_heads"),
    ("mha-num_heads-0", _mha(num_heads=0), VE, "num_heads"),
    ("mha-num_heads-negative", _mha(num_heads=-2), VE, "num_heads"),
    ("mha-num_heads-float", _mha(num_heads=2.0), TE, "num_heads"),
    ("mha-num_heads-bool", _mha(num_heads=True), TE, "num_heads"),
    ("mha-num_heads-str", _mha(num_heads="2"), TE, "num_heads"),
    ("mha-num_heads-none", _mha(num_heads=None), TE, "num_heads"),
    ("mha-num_kv_heads-0", _mha(num_kv_heads=0), VE, "num_kv_heads"),
    ("mha-num_kv_heads-float", _mha(num_kv_heads=1.5), TE, "num_kv_heads"),
    ("mha-num_kv_heads-bool", _mha(num_kv_heads=True), TE, "num_kv_heads"),
    # ---------------- data dtypes
    ("mha-query-complex", _mha(query=C(2, 5, D)), TE, "query"),
    ("mha-query-bool", _mha(query=np.ones((2, 5, D), bool)), TE, "query"),
    ("mha-query-object", _mha(query=np.ones((2, 5, D), object)), TE, "query"),
    ("mha-query-str", _mha(query=np.full((2, 5, D), "a")), TE, "query"),
    ("mha-query-datetime", _mha(query=np.ones((2, 5, D), "datetime64[s]")), TE, "query"),
    ("mha-query-ragged", _mha(query=[[1.0, 2.0], [3.0]]), TE, "query"),
    ("mha-query-none", _mha(query=None), TE, "query"),
    ("mha-key-complex", _mha(key=C(2, 6, D)), TE, "key"),
    ("mha-value-bool", _mha(value=np.ones((2, 6, D), bool)), TE, "value"),
    ("mha-w_q-complex", _mha(w_q=C(D, D)), TE, "w_q"),
    ("mha-w_k-object", _mha(w_k=np.ones((D, D), object)), TE, "w_k"),
    ("mha-w_v-bool", _mha(w_v=np.ones((D, D), bool)), TE, "w_v"),
    ("mha-w_o-str", _mha(w_o=np.full((D, D), "x")), TE, "w_o"),
    ("mha-w_o-none", _mha(w_o=None), TE, "w_o"),
    ("mha-b_q-complex", _mha(b_q=C(D)), TE, "b_q"),
    ("mha-b_o-bool", _mha(b_o=np.ones(D, bool)), TE, "b_o"),
    # ---------------- biases
    ("mha-b_q-shape", _mha(b_q=E(D + 1)), VE, "b_q"),
    ("mha-b_k-2d", _mha(b_k=E((1, D))), VE, "b_k"),
    ("mha-b_v-scalar", _mha(b_v=1.0), VE, "b_v"),
    ("mha-b_o-shape", _mha(b_o=E(D - 1)), VE, "b_o"),
    # ---------------- masks
    ("mha-mask-int", _mha(mask=np.ones((5, 6), int)), TE, "mask"),
    ("mha-mask-uint8", _mha(mask=np.ones((5, 6), np.uint8)), TE, "mask"),
    ("mha-mask-complex", _mha(mask=C(5, 6)), TE, "mask"),
    ("mha-mask-object", _mha(mask=np.ones((5, 6), object)), TE, "mask"),
    ("mha-mask-str", _mha(mask=np.full((5, 6), "a")), TE, "mask"),
    ("mha-mask-shape", _mha(mask=np.ones((6, 5), bool)), VE, "mask"),
    ("mha-mask-heads", _mha(mask=np.ones((3, 5, 6), bool)), VE, "mask"),
    ("mha-mask-batch", _mha(mask=np.ones((3, 1, 5, 6), bool)), VE, "mask"),
    ("mha-mask-too-many-dims", _mha(mask=np.ones((2, 2, 2, 5, 6), bool)), VE, "mask"),
    ("mha-kpm-float", _mha(key_padding_mask=np.ones((2, 6))), TE, "key_padding_mask"),
    ("mha-kpm-int", _mha(key_padding_mask=np.ones((2, 6), int)), TE, "key_padding_mask"),
    ("mha-kpm-shape", _mha(key_padding_mask=np.ones((2, 5), bool)), VE, "key_padding_mask"),
    ("mha-kpm-batch", _mha(key_padding_mask=np.ones((3, 6), bool)), VE, "key_padding_mask"),
    # ---------------- options
    ("mha-causal-str", _mha(causal="bottom"), VE, "causal"),
    ("mha-causal-int", _mha(causal=2), VE, "causal"),
    ("mha-causal-float", _mha(causal=1.0), VE, "causal"),
    ("mha-causal-list", _mha(causal=[True]), VE, "causal"),
    ("mha-return_weights-str", _mha(return_weights="all"), VE, "return_weights"),
    ("mha-return_weights-case", _mha(return_weights="Heads"), VE, "return_weights"),
    ("mha-return_weights-int", _mha(return_weights=2), VE, "return_weights"),
    ("mha-return_weights-array", _mha(return_weights=np.array([1, 2])), VE, "return_weights"),
    ("mha-scale-nan", _mha(scale=float("nan")), VE, "scale"),
    ("mha-scale-inf", _mha(scale=float("inf")), VE, "scale"),
    ("mha-scale-neginf", _mha(scale=-np.inf), VE, "scale"),
    ("mha-scale-str", _mha(scale="0.5"), TE, "scale"),
    ("mha-scale-complex", _mha(scale=0.5j), TE, "scale"),
    ("mha-scale-bool", _mha(scale=True), TE, "scale"),
    # ---------------- batch dims
    ("mha-batch-mismatch", _mha(key=E((3, 6, D)), value=E((3, 6, D))), VE, "batch|query|key"),
    ("mha-batch-mismatch-value", _mha(value=E((4, 6, D))), VE, "batch|value"),
    (
        "mha-batch-mismatch-2d",
        _mha(query=E((2, 3, 5, D)), key=E((3, 2, 6, D)), value=E((3, 2, 6, D))),
        VE,
        "batch|query|key",
    ),
    # ---------------- zero-width feature axes
    ("mha-query-d0", _mha(query=E((2, 5, 0)), w_q=E((0, D))), VE, "query|d_q"),
    ("mha-query-d0-vs-w_q", _mha(query=E((2, 5, 0))), VE, "w_q|query"),
    # ---------------- scaled_dot_product_attention
    ("sdpa-q-2d", _sdpa(q=E((5, 8))), VE, "q"),
    ("sdpa-k-2d", _sdpa(k=E((6, 8))), VE, "k"),
    ("sdpa-v-2d", _sdpa(v=E((6, 3))), VE, "v"),
    ("sdpa-q-scalar", _sdpa(q=1.0), VE, "q"),
    ("sdpa-k-width", _sdpa(k=E((2, 2, 6, 7))), VE, "k"),
    ("sdpa-v-tokens", _sdpa(v=E((2, 2, 7, 3))), VE, "v"),
    ("sdpa-v-heads", _sdpa(v=E((2, 1, 6, 3))), VE, "v"),
    ("sdpa-kv-heads-not-dividing", _sdpa(q=E((2, 3, 5, 8))), VE, "k"),
    ("sdpa-kv-heads-more-than-q", _sdpa(k=E((2, 8, 6, 8)), v=E((2, 8, 6, 3))), VE, "k"),
    ("sdpa-q-zero-heads", _sdpa(q=E((2, 0, 5, 8))), VE, "q"),
    ("sdpa-d0", _sdpa(q=E((2, 4, 5, 0)), k=E((2, 2, 6, 0))), VE, "q"),
    ("sdpa-batch", _sdpa(k=E((3, 2, 6, 8)), v=E((3, 2, 6, 3))), VE, "batch|q|k"),
    ("sdpa-q-complex", _sdpa(q=C(2, 4, 5, 8)), TE, "q"),
    ("sdpa-k-bool", _sdpa(k=np.ones((2, 2, 6, 8), bool)), TE, "k"),
    ("sdpa-v-object", _sdpa(v=np.ones((2, 2, 6, 3), object)), TE, "v"),
    ("sdpa-v-str", _sdpa(v=np.full((2, 2, 6, 3), "s")), TE, "v"),
    ("sdpa-q-none", _sdpa(q=None), TE, "q"),
    ("sdpa-mask-int", _sdpa(mask=np.ones((5, 6), np.int32)), TE, "mask"),
    ("sdpa-mask-complex", _sdpa(mask=C(5, 6)), TE, "mask"),
    ("sdpa-mask-object", _sdpa(mask=np.ones((5, 6), object)), TE, "mask"),
    ("sdpa-mask-shape", _sdpa(mask=np.ones((5, 5), bool)), VE, "mask"),
    ("sdpa-mask-heads", _sdpa(mask=np.ones((2, 5, 6))), VE, "mask"),
    ("sdpa-causal", _sdpa(causal="top-left"), VE, "causal"),
    ("sdpa-return_weights", _sdpa(return_weights="weights"), VE, "return_weights"),
    ("sdpa-scale-nan", _sdpa(scale=np.nan), VE, "scale"),
    ("sdpa-scale-inf", _sdpa(scale=np.inf), VE, "scale"),
    ("sdpa-scale-str", _sdpa(scale="1"), TE, "scale"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error(call, exc, match):
    with pytest.raises(exc, match=match) as info:
        call()
    # exactly the documented type (not a subclass such as IndexError posing as ValueError...)
    assert type(info.value) in (ValueError, TypeError)


def test_cases_are_valid_otherwise():
    """The base calls the cases mutate are themselves valid."""
    assert _mha()().shape == (2, 5, D)
    assert _sdpa()().shape == (2, 4, 5, 3)


@pytest.mark.parametrize("num_heads", [np.int64(2), np.int32(2), 2])
def test_numpy_integers_accepted(num_heads):
    assert _mha(num_heads=num_heads)().shape == (2, 5, D)


def test_no_crash_in_subprocess():
    """Replays every case in a child process: all raise, none crash (segfault, abort)."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {here!r})
        import test_errors as t
        n = 0
        for name, call, exc, match in t.CASES:
            try:
                call()
            except (ValueError, TypeError):
                n += 1
            except Exception as e:
                print("unexpected", name, type(e).__name__, e)
            else:
                print("no error", name)
        print("done", n)
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(attnlab.__file__)), env.get("PYTHONPATH", "")]
    )
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert res.returncode == 0, f"child died with {res.returncode}: {res.stderr[-2000:]}"
    assert "done" in res.stdout, res.stdout
