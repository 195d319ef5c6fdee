"""Threads: many Python threads calling at once get bitwise the serial
results; the kernel thread count does not change a bit of any result; the GIL is released
around every kernel call.

No timing assertions: GIL release is shown by a second Python thread that keeps executing
bytecode *during* a long kernel call (with the GIL held it could not run at all, so its longest
stall would be the whole call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnlab

D, H, N = 32, 4, 48


def _cases(dtype: Any, n: int = N, batch: int = 2) -> dict[str, Callable[[], Any]]:
    """One call of every public function (forward and backward), small but multi-block."""
    rng = np.random.default_rng(7)
    r = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    u = lambda *s: (rng.uniform(-1, 1, s) / np.sqrt(s[0])).astype(dtype)  # noqa: E731
    x = r(batch, n, D)
    mha = dict(
        w_q=u(D, D),
        w_k=u(D, D // 2),
        w_v=u(D, D // 2),
        w_o=u(D, D),
        b_q=r(D),
        b_k=r(D // 2),
        b_v=r(D // 2),
        b_o=r(D),
        num_heads=H,
        num_kv_heads=H // 2,
    )
    kpm = rng.random((batch, n)) < 0.8
    q, k, v = r(batch, H, n, D // H), r(batch, H // 2, n, D // H), r(batch, H // 2, n, 8)
    mask = rng.random((n, n)) < 0.7
    qk = attnlab.collapse_qk(
        mha["w_q"], mha["w_k"], mha["b_q"], mha["b_k"], num_heads=H, num_kv_heads=H // 2
    )
    bil = dict(
        w_qk=qk,
        w_v=mha["w_v"],
        w_o=mha["w_o"],
        b_v=mha["b_v"],
        b_o=mha["b_o"],
        num_heads=H,
        num_kv_heads=H // 2,
    )
    add = dict(
        w_q=u(D, D),
        b_q=r(D),
        w_k=u(D, D),
        b_k=r(D),
        w_g=r(D),
        w_proj=u(D, D),
        b_proj=r(D),
        w_final=u(D, D),
        b_final=r(D),
    )
    sep = dict(w_qkv=u(D, 1 + 2 * D), b_qkv=r(1 + 2 * D), w_o=u(D, D), b_o=r(D))
    g = r(batch, n, D)
    gs = r(batch, H, n, 8)
    # precision="bf16" takes float32
    bf16 = (
        {
            "additive_bf16": lambda: attnlab.additive_attention(
                x, key_padding_mask=kpm, precision="bf16", **add
            ),
            "separable_bf16": lambda: attnlab.separable_attention(
                x, key_padding_mask=kpm, precision="bf16", **sep
            ),
        }
        if dtype == np.float32
        else {}
    )
    return bf16 | {
        "sdpa": lambda: attnlab.scaled_dot_product_attention(
            q, k, v, mask=mask, return_weights=True
        ),
        "sdpa_causal": lambda: attnlab.scaled_dot_product_attention(q, k, v, causal=True),
        "sdpa_backward": lambda: attnlab.scaled_dot_product_attention_backward(
            gs, q, k, v, mask=mask
        ),
        "mha": lambda: attnlab.multi_head_attention(
            x, key_padding_mask=kpm, return_weights="mean", **mha
        ),
        "mha_backward": lambda: attnlab.multi_head_attention_backward(
            g, x, key_padding_mask=kpm, causal=True, **mha
        ),
        "bilinear": lambda: attnlab.bilinear_attention(x, key_padding_mask=kpm, **bil),
        "bilinear_backward": lambda: attnlab.bilinear_attention_backward(
            g, x, causal="bottom_right", **bil
        ),
        "additive": lambda: attnlab.additive_attention(x, key_padding_mask=kpm, **add),
        "additive_hf": lambda: attnlab.additive_attention(x, variant="hf", **add),
        "additive_backward": lambda: attnlab.additive_attention_backward(
            g, x, key_padding_mask=kpm, **add
        ),
        "separable": lambda: attnlab.separable_attention(x, key_padding_mask=kpm, **sep),
        "separable_backward": lambda: attnlab.separable_attention_backward(g, x, **sep),
        "collapse_qk": lambda: attnlab.collapse_qk(
            mha["w_q"], mha["w_k"], mha["b_q"], num_heads=H, num_kv_heads=H // 2
        ),
    }


def _bytes(result: Any) -> Any:
    """Every array of a result as bytes (dtype and shape included), for bitwise comparison."""
    if isinstance(result, np.ndarray):
        return (result.dtype.str, result.shape, result.tobytes())
    if isinstance(result, dict):
        return {k: _bytes(v) for k, v in sorted(result.items())}
    if isinstance(result, tuple):
        return tuple(_bytes(v) for v in result)
    if isinstance(result, attnlab.BilinearQK):
        return tuple(_bytes(getattr(result, f)) for f in ("w", "u", "v", "c")) + (result.d_head,)
    return result


@pytest.fixture
def restore_threads():
    before = attnlab.get_num_threads()
    yield
    attnlab.set_num_threads(before)


@pytest.mark.empty_rows
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_eight_threads_get_the_serial_results_bitwise(dtype: Any) -> None:
    cases = _cases(dtype)
    serial = {name: _bytes(f()) for name, f in cases.items()}
    names = list(cases)
    failures: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            order = names[i % len(names) :] + names[: i % len(names)]  # all families at once
            start.wait()
            for _ in range(3):
                failures.extend(
                    f"thread {i}: {name}" for name in order if _bytes(cases[name]()) != serial[name]
                )
        except BaseException as exc:  # noqa: BLE001 (the main thread re-raises what a worker hit)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not failures, failures


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.usefixtures("restore_threads")
def test_one_and_two_kernel_threads_are_bitwise_equal(dtype: Any) -> None:
    cases = _cases(dtype, n=300, batch=3)  # several row blocks per batch element
    results = {}
    for threads in (1, 2, 1):
        attnlab.set_num_threads(threads)
        assert attnlab.get_num_threads() == threads
        results[threads] = {name: _bytes(f()) for name, f in cases.items()}
    different = [n for n in cases if results[1][n] != results[2][n]]
    assert not different, f"results depend on the thread count: {different}"


def _longest_stall_during(call: Callable[[], Any]) -> tuple[float, float, int]:
    """Runs ``call`` while a second Python thread spins on pure-Python bytecode; returns
    (duration of the call, longest gap between two iterations of the spinner during the
    call, iterations during the call)."""
    state = {"stop": False, "active": False, "gap": 0.0, "n": 0}

    def spin() -> None:
        last = time.perf_counter()
        while not state["stop"]:
            now = time.perf_counter()
            if state["active"]:
                state["gap"] = max(state["gap"], now - last)
                state["n"] += 1
            last = now

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.02)
    state["active"] = True
    t0 = time.perf_counter()
    call()
    duration = time.perf_counter() - t0
    state["active"] = False
    state["stop"] = True
    t.join()
    return duration, float(state["gap"]), int(state["n"])


def _long_calls() -> dict[str, Callable[[], Any]]:
    """One call per kernel entry point, each long enough (>~0.2 s on one core) that a held
    GIL would stall the spinner for a visible fraction of it."""
    rng = np.random.default_rng(1)
    n, d = 1536, 64
    x = rng.standard_normal((1, n, d))
    w = {k: rng.standard_normal((d, d)) / 8 for k in ("w_q", "w_k", "w_v", "w_o")}
    q = rng.standard_normal((1, 4, n, d))
    qk = attnlab.collapse_qk(w["w_q"], w["w_k"], num_heads=4)
    xa = rng.standard_normal((64, 1024, d))
    add = {k: rng.standard_normal((d, d)) / 8 for k in ("w_q", "w_k", "w_proj", "w_final")}
    sep = dict(w_qkv=rng.standard_normal((d, 1 + 2 * d)) / 8, w_o=rng.standard_normal((d, d)))
    g, ga = np.ones((1, n, d)), np.ones((64, 1024, d))
    return {
        "sdpa_forward": lambda: attnlab.scaled_dot_product_attention(q, q, q),
        "sdpa_backward": lambda: attnlab.scaled_dot_product_attention_backward(q, q, q, q),
        "mha_forward": lambda: attnlab.multi_head_attention(x, num_heads=4, **w),
        "mha_backward": lambda: attnlab.multi_head_attention_backward(g, x, num_heads=4, **w),
        "bilinear_forward": lambda: attnlab.bilinear_attention(
            x, w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], num_heads=4
        ),
        "bilinear_backward": lambda: attnlab.bilinear_attention_backward(
            g, x, w_qk=qk, w_v=w["w_v"], w_o=w["w_o"], num_heads=4
        ),
        "additive_forward": lambda: attnlab.additive_attention(xa, w_g=np.ones(d), **add),
        "additive_backward": lambda: attnlab.additive_attention_backward(
            ga, xa, w_g=np.ones(d), **add
        ),
        "separable_forward": lambda: attnlab.separable_attention(xa, **sep),
        "separable_backward": lambda: attnlab.separable_attention_backward(ga, xa, **sep),
    }


@pytest.mark.parametrize("entry", list(_long_calls()))
@pytest.mark.usefixtures("restore_threads")
def test_gil_is_released_during_kernels(entry: str) -> None:
    """With one kernel thread, a Python thread keeps running during the call: its longest
    stall is well under half the call (with the GIL held it would be the whole call). Up to
    three attempts, so a busy machine descheduling the spinner once cannot fail the test; a
    held GIL fails all three."""
    call = _long_calls()[entry]
    attnlab.set_num_threads(1)
    call()  # warm up
    seen = []
    for _ in range(3):
        duration, gap, n = _longest_stall_during(call)
        seen.append((round(duration, 3), round(gap, 3), n))
        if n > 100 and gap < 0.5 * duration:
            return
    pytest.fail(f"{entry}: the GIL looks held (duration, longest stall, iterations): {seen}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_repeated_calls_are_bitwise_equal_whatever_the_heap_holds(dtype: Any) -> None:
    """The same call gives the same bits while unrelated allocations come and go (outputs and
    internal copies are 64-byte aligned, see ``attnlab._memory.empty``, so where the heap
    puts them cannot change how Eigen peels its vector loops)."""
    cases = _cases(dtype, n=20, batch=2)
    first = {name: _bytes(f()) for name, f in cases.items()}
    rng = np.random.default_rng(0)
    for _ in range(15):
        junk = [
            np.empty(int(rng.integers(1, 300)), np.uint8) for _ in range(int(rng.integers(1, 40)))
        ]
        again = {name: _bytes(f()) for name, f in cases.items()}
        del junk
        assert again == first, [n for n in cases if again[n] != first[n]]
