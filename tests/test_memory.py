"""Memory: no leak over many calls, and sizes that cannot be allocated raise
``MemoryError`` (or ``ValueError``), never crash.

Both run in a fresh subprocess: the leak test so that nothing else in the test session changes
the resident set size, the allocation test so that a crash is reported as a failure instead of
killing the test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import attnlab
from conftest import in_fresh_process

CALLS = 10_000
LIMIT_MIB = 5.0
SANITIZED = bool(os.environ.get("ATTNLAB_SANITIZED"))  # set by scripts/sanitize.sh


def _run(code: str, timeout: float = 300) -> dict:
    env = dict(os.environ)
    root = str(Path(attnlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"status {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


LEAK = """
import gc, json, os, sys
import numpy as np
import attnlab

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else {calls}
PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

rng = np.random.default_rng(0)
r = lambda *s: rng.standard_normal(s)
d, h, n = 8, 2, 6
x = r(2, n, d)
mha = dict(w_q=r(d, d) / 3, w_k=r(d, d) / 3, w_v=r(d, d) / 3, w_o=r(d, d) / 3, b_q=r(d),
           b_o=r(d), num_heads=h)
kpm = np.array([[True] * n, [True] * (n - 2) + [False] * 2])
q, k, v = r(2, h, n, 4), r(2, 1, n, 4), r(2, 1, n, 3)
qk = attnlab.collapse_qk(mha["w_q"], mha["w_k"], mha["b_q"], num_heads=h)
bil = dict(w_qk=qk, w_v=mha["w_v"], w_o=mha["w_o"], b_o=mha["b_o"], num_heads=h)
add = dict(w_q=r(d, d) / 3, b_q=r(d), w_k=r(d, d) / 3, w_g=r(d), w_proj=r(d, d) / 3,
           w_final=r(d, d) / 3, b_final=r(d))
sep = dict(w_qkv=r(d, 1 + 2 * d) / 3, w_o=r(d, d) / 3, b_o=r(d))
g = r(2, n, d)
xf = np.asfortranarray(r(2, n, d)).astype(np.float32)   # conversions and copies too

def invalid():
    try:
        attnlab.multi_head_attention(x, **{{**mha, "num_heads": 3}})
    except ValueError:
        pass
    try:
        attnlab.additive_attention(x.astype(complex), **add)
    except TypeError:
        pass

families = {{
    "scaled_dot_product_attention": lambda: attnlab.scaled_dot_product_attention(
        q, k, v, causal=True, return_weights=True),
    "scaled_dot_product_attention_backward": lambda:
        attnlab.scaled_dot_product_attention_backward(r(2, h, n, 3), q, k, v),
    "multi_head_attention": lambda: attnlab.multi_head_attention(
        x, key_padding_mask=kpm, return_weights="mean", **mha),
    "multi_head_attention_backward": lambda: attnlab.multi_head_attention_backward(
        g, xf, key_padding_mask=kpm, **mha),
    "bilinear_attention": lambda: attnlab.bilinear_attention(x, causal=True, **bil),
    "bilinear_attention_backward": lambda: attnlab.bilinear_attention_backward(g, x, **bil),
    "additive_attention": lambda: attnlab.additive_attention(x, key_padding_mask=kpm, **add),
    "additive_attention_backward": lambda: attnlab.additive_attention_backward(
        g, xf, variant="hf", **add),
    "separable_attention": lambda: attnlab.separable_attention(x, **sep),
    "separable_attention_backward": lambda: attnlab.separable_attention_backward(
        g, x, key_padding_mask=kpm, **sep),
    "collapse_qk": lambda: attnlab.collapse_qk(mha["w_q"], mha["w_k"], mha["b_q"],
                                               num_heads=h),
    "invalid calls": invalid,
}}
growth = {{}}
for name, f in families.items():
    for _ in range(1000):   # warm-up: caches, thread pool, allocator arenas
        f()
    gc.collect()
    before = rss()
    for _ in range(CALLS):
        f()
    gc.collect()
    growth[name] = (rss() - before) / 2**20
print(json.dumps(growth))
"""


@pytest.mark.skipif(SANITIZED, reason="AddressSanitizer's quarantine holds freed memory")
def test_rss_does_not_grow_over_ten_thousand_calls_per_family() -> None:
    growth = _run(LEAK.format(calls=CALLS))
    print(
        "\nRSS growth over",
        CALLS,
        "calls (MiB):",
        json.dumps({k: round(v, 3) for k, v in growth.items()}),
    )
    assert len(growth) == 12
    leaking = {k: v for k, v in growth.items() if v >= LIMIT_MIB}
    assert not leaking, f"resident memory grew by >= {LIMIT_MIB} MiB: {leaking}"


# Each case must raise MemoryError or ValueError. Inputs are zero-strided (np.broadcast_to),
# so the test itself allocates almost nothing; the sizes are far beyond any machine so that
# Linux's heuristic overcommit refuses them instead of handing out pages it cannot back.
HUGE = """
import json
import os
import numpy as np
import attnlab

# Under AddressSanitizer a failing C++ `new` aborts the process whatever allocator_may_return_null
# says (only malloc returns NULL), so the cases that fail inside the kernels are left out there.
sanitized = bool(os.environ.get("ATTNLAB_SANITIZED"))

one = lambda *shape: np.broadcast_to(np.ones(()), shape)
n = 2**22          # tokens: the rows themselves fit (32 MiB), their n x n scores do not
w = lambda i, o: np.ones((i, o)) / o
results = {}

def case(name, f, cxx=False):
    if cxx and sanitized:
        results[name] = "skipped (sanitizer)"
        return
    try:
        f()
        results[name] = "no error"
    except (MemoryError, ValueError) as exc:
        results[name] = type(exc).__name__
    except Exception as exc:  # noqa: BLE001 (any other exception is reported as unexpected)
        results[name] = f"unexpected {type(exc).__name__}: {exc}"

mha = dict(w_q=w(1, 4), w_k=w(1, 4), w_v=w(1, 4), w_o=w(4, 1), num_heads=2)
case("sdpa weights (n_q = 2**42)", lambda: attnlab.scaled_dot_product_attention(
    one(1, 1, 2**42, 2), one(1, 1, 3, 2), one(1, 1, 3, 2), return_weights=True))
case("sdpa output (batch 2**50)", lambda: attnlab.scaled_dot_product_attention(
    one(2**50, 1, 1, 1), one(1, 1, 1), one(1, 1, 1)))
case("mha weights (n = 2**22)", lambda: attnlab.multi_head_attention(
    one(1, n, 1), return_weights=True, **mha))
case("mha mean weights (n = 2**22)", lambda: attnlab.multi_head_attention(
    one(1, n, 1), return_weights="mean", **mha))
case("mha projections (n * width = 2**34)", lambda: attnlab.multi_head_attention(
    one(1, n, 1), w_q=w(1, 2**12), w_k=w(1, 2**12), w_v=w(1, 4), w_o=w(4, 1), num_heads=4),
    cxx=True)
case("mha backward projections", lambda: attnlab.multi_head_attention_backward(
    one(1, n, 1), one(1, n, 1), w_q=w(1, 2**12), w_k=w(1, 2**12), w_v=w(1, 4),
    w_o=w(4, 1), num_heads=4), cxx=True)
case("mha batch (2**41 rows)", lambda: attnlab.multi_head_attention(
    one(2**20, 2**21, 1), **mha))
case("bilinear weights (n = 2**22)", lambda: attnlab.bilinear_attention(
    one(1, n, 1), w_qk=np.ones((2, 1, 1)), w_v=w(1, 2), w_o=w(2, 1), num_heads=2,
    return_weights=True))
case("bilinear projections", lambda: attnlab.bilinear_attention(
    one(1, n, 1), one(1, n, 4), w_qk=np.ones((2**10, 1, 4)), w_v=w(4, 2**10),
    w_o=w(2**10, 1), num_heads=2**10), cxx=True)
case("bilinear backward projections", lambda: attnlab.bilinear_attention_backward(
    one(1, n, 1), one(1, n, 1), one(1, n, 4), w_qk=np.ones((2**10, 1, 4)),
    w_v=w(4, 2**10), w_o=w(2**10, 1), num_heads=2**10), cxx=True)
case("additive projections (n * D = 2**34)", lambda: attnlab.additive_attention(
    one(1, n, 1), w_q=w(1, 2**12), w_k=w(1, 2**12), w_g=np.ones(2**12),
    w_proj=np.broadcast_to(np.eye(1), (2**12, 2**12)), w_final=w(2**12, 1)), cxx=True)
case("additive backward projections", lambda: attnlab.additive_attention_backward(
    one(1, n, 1), one(1, n, 1), w_q=w(1, 2**12), w_k=w(1, 2**12), w_g=np.ones(2**12),
    w_proj=np.broadcast_to(np.eye(1), (2**12, 2**12)), w_final=w(2**12, 1)), cxx=True)
case("additive batch (2**41 rows)", lambda: attnlab.additive_attention(
    one(2**20, 2**21, 1), w_q=w(1, 2), w_k=w(1, 2), w_g=np.ones(2), w_proj=w(2, 2),
    w_final=w(2, 1)))
case("separable batch (2**41 rows)", lambda: attnlab.separable_attention(
    one(2**20, 2**21, 1), w_qkv=w(1, 3), w_o=w(1, 1)))
case("separable backward batch", lambda: attnlab.separable_attention_backward(
    one(2**20, 2**21, 1), one(2**20, 2**21, 1), w_qkv=w(1, 3), w_o=w(1, 1)))
case("collapse_qk (h * d_q * d_k = 2**44)", lambda: attnlab.collapse_qk(
    one(2**22, 4), one(2**22, 4), num_heads=1))
print(json.dumps(results))
"""


def test_impossible_sizes_raise_memory_error_not_crash() -> None:
    results = _run(HUGE, timeout=600)
    print("\n" + "\n".join(f"{k:>40s}: {v}" for k, v in results.items()))
    ok = ("MemoryError", "ValueError") + (("skipped (sanitizer)",) if SANITIZED else ())
    bad = {k: v for k, v in results.items() if v not in ok}
    assert not bad, bad


# -- the recycled memory of large arrays (_memory._Blocks) ---------------------------------------

BIG = (512, 1024)  # 2 MiB of float32: above the size from which blocks are recycled


def _blocks_or_skip():
    from attnlab import _memory as memory

    if not memory._blocks.usable:
        pytest.skip("no private anonymous mappings here: NumPy's memory is used")
    return memory


def test_a_dropped_array_s_memory_serves_the_next_array_of_its_size() -> None:
    memory = _blocks_or_skip()
    a = memory.empty(BIG, np.float32)
    where = a.ctypes.data
    assert where % 64 == 0 and a.flags.c_contiguous and a.flags.writeable
    del a
    b = memory.empty(BIG, np.float32)
    assert b.ctypes.data == where
    c = memory.empty(BIG, np.float32)  # b is alive: never handed out twice
    assert c.ctypes.data != b.ctypes.data


def test_a_view_keeps_its_block_out_of_reuse() -> None:
    memory = _blocks_or_skip()
    a = memory.empty(BIG, np.float32)
    a[...] = 1.0
    view = a[3:5, ::2].T  # a view of a view: keeps the block as long as it lives
    del a
    b = memory.empty(BIG, np.float32)
    b[...] = 2.0
    assert np.all(view == 1.0)
    assert not np.shares_memory(view, b)


def test_the_blocks_kept_are_bounded() -> None:
    memory = _blocks_or_skip()
    memory._blocks.clear()
    n = memory._Blocks.LIMIT // (8 << 20) + 4
    arrays = [memory.empty((8 << 20,), np.uint8) for _ in range(n)]
    del arrays
    assert 0 < memory._blocks.waiting <= memory._Blocks.LIMIT
    memory._blocks.clear()
    assert memory._blocks.waiting == 0


def test_vjp_copies_are_freed_without_the_garbage_collector() -> None:
    """The pullback's copies of the arguments go when the pullback goes (a reference cycle
    once kept them until the collector ran, so every training step took fresh memory). In a
    fresh process: the collector's count is process-wide, and threads earlier tests left (a
    Dask client's) make garbage of their own."""
    in_fresh_process("import test_memory as t; t._vjp_copies_freed()")


def _vjp_copies_freed() -> None:
    import gc
    import weakref

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 40, 16))
    w = {k: rng.standard_normal((16, 16)) for k in ("w_q", "w_k", "w_v", "w_o")}
    gc.collect()
    gc.disable()
    try:
        out, pullback = attnlab.vjp(attnlab.multi_head_attention, x, num_heads=2, **w)
        grads = pullback(np.ones_like(out))
        alive = weakref.ref(pullback)
        del out, pullback, grads
        assert alive() is None
        assert gc.collect() == 0
    finally:
        gc.enable()


FORKED = """
import json, os
import numpy as np
from attnlab import _memory as memory

a = memory.empty((512, 1024), np.float32)
a[...] = 1.0
del a                      # the block waits in the parent's cache
pid = os.fork()
if pid == 0:               # the child writes into the same block
    b = memory.empty((512, 1024), np.float32)
    b[...] = 7.0
    os._exit(0)
os.waitpid(pid, 0)
c = memory.empty((512, 1024), np.float32)
print(json.dumps({"parent_sees": float(c[0, 0]), "usable": memory._blocks.usable}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_its_own_copy_of_a_recycled_block() -> None:
    r = _run(FORKED)
    if not r["usable"]:
        pytest.skip("no private anonymous mappings here")
    assert r["parent_sees"] == 1.0


def test_a_block_given_back_while_the_cache_is_busy_is_kept_later() -> None:
    """A finalizer can run while the cache's lock is held (the garbage collector inside a
    locked section, or another thread): it must not wait for the lock (a deadlock in the first
    case); the block is kept by the next call instead."""
    memory = _blocks_or_skip()
    memory._blocks.clear()
    a = memory.empty(BIG, np.float32)
    where = a.ctypes.data
    memory._blocks._lock.acquire()  # as if the collector dropped `a` inside a locked section
    try:
        del a  # the finalizer runs now, with the lock held: it must return at once
    finally:
        memory._blocks._lock.release()
    assert memory._blocks.waiting > 0
    assert memory.empty(BIG, np.float32).ctypes.data == where


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("family", ["mha_self", "mha_cross", "sdpa"])
def test_gradients_do_not_depend_on_what_recycled_memory_held(family: str, dtype: type) -> None:
    # The MHA and SDPA backwards write their gradients into unzeroed buffers (the kernel writes
    # every element). Poisoned blocks of every size the gradients take (all bits set: NaN)
    # must not change a single bit of them.
    memory = _blocks_or_skip()
    rng = np.random.default_rng(7)
    B, n, nk, d, h = 2, 80, 72, 192, 3
    if family == "sdpa":
        q = rng.standard_normal((B, h, n, 64)).astype(dtype)
        k, v = (rng.standard_normal((B, h, nk, 64)).astype(dtype) for _ in range(2))

        def grads() -> dict[str, np.ndarray]:
            out, pull = attnlab.vjp(attnlab.scaled_dot_product_attention, q, k, v, causal=True)
            return {
                **pull(np.ones_like(out)),
                **{
                    "b_" + key: val
                    for key, val in attnlab.scaled_dot_product_attention_backward(
                        np.ones_like(out), q, k, v, causal=True
                    ).items()
                },
            }
    else:
        x = rng.standard_normal((B, n, d)).astype(dtype)
        kv = rng.standard_normal((B, nk, d)).astype(dtype)
        w = {
            k: (rng.standard_normal((d, d)) / 14).astype(dtype)
            for k in ("w_q", "w_k", "w_v", "w_o")
        }
        w.update({k: rng.standard_normal(d).astype(dtype) for k in ("b_q", "b_k", "b_v", "b_o")})
        args = (x,) if family == "mha_self" else (x, kv, kv)

        def grads() -> dict[str, np.ndarray]:
            out, pull = attnlab.vjp(attnlab.multi_head_attention, *args, num_heads=h, **w)
            g = np.ones_like(out)
            back = attnlab.multi_head_attention_backward(g, *args, num_heads=h, **w)
            return {**pull(g), **{"b_" + key: val for key, val in back.items()}}

    memory._blocks.clear()
    clean = grads()
    sizes = {a.nbytes for a in clean.values()}
    poison = [memory.empty((s,), np.uint8) for s in sorted(sizes) for _ in range(4)]
    for p in poison:
        p.fill(0xFF)
    del poison
    assert memory._blocks.waiting > 0
    again = grads()
    for key, val in clean.items():
        assert np.array_equal(val, again[key]), key
    memory._blocks.clear()


def test_copy_arrays_copies_every_byte_of_every_pair() -> None:
    # attnlab.vjp's copies of its arguments run on the pool in 256 KiB chunks: blocks of every
    # size around the chunk, empty ones among them, land whole and nowhere else.
    from attnlab import _core

    rng = np.random.default_rng(3)
    sizes = [0, 1, 7, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, 0, 3 << 20]
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dst = [np.zeros(n + 2, np.uint8) for n in sizes]  # a guard byte either side
    _core.copy_arrays([(d[1:-1], s) for d, s in zip(dst, src, strict=True)])
    for d, s in zip(dst, src, strict=True):
        assert np.array_equal(d[1:-1], s) and d[0] == 0 and d[-1] == 0
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.copy_arrays([(np.zeros(4), np.zeros(8)[::2])])
    with pytest.raises(ValueError, match="bytes"):
        _core.copy_arrays([(np.zeros(4), np.zeros(5))])
    with pytest.raises(TypeError, match="pairs"):
        _core.copy_arrays([(np.zeros(4),)])
