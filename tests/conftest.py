"""Shared fixtures: a seeded generator, random MHA weights, and a tolerance-aware comparison.

The largest error of every comparison made through ``assert_close`` is recorded per
(label, dtype) and printed at the end of the run, so the accuracy reached is visible.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Relative tolerances (against a float64 oracle), normwise: |got - ref| <= tol * (|ref| + max|ref|)
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
# half-precision storage: computed in float32 from the exact inputs, one rounding to the storage's
# unit roundoff u at the end (2**-11, 2**-8): within 2u of the float64 result of the same inputs
TOL[np.dtype(np.float16)] = 2.0**-10
try:
    import ml_dtypes

    BF16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
    TOL[BF16] = 2.0**-7
except ImportError:  # bfloat16 tests skip
    BF16 = None

_MAX_ERR: dict[tuple[str, str], float] = defaultdict(float)


def make_mha_weights(
    rng: np.random.Generator,
    d_q: int,
    num_heads: int,
    d_head: int,
    *,
    d_k: int | None = None,
    d_v: int | None = None,
    num_kv_heads: int | None = None,
    d_vhead: int | None = None,
    d_out: int | None = None,
    bias: bool | str = True,
    dtype: Any = np.float64,
) -> dict[str, np.ndarray]:
    """Keyword arguments ``w_q .. b_o`` for ``multi_head_attention``.

    Weights are U(+-1/sqrt(fan_in)) (nn.Linear's default) so the softmax is not saturated.
    ``bias`` is True (all four), False (none) or a string of letters among "qkvo".
    """
    d_k = d_q if d_k is None else d_k
    d_v = d_k if d_v is None else d_v
    h_kv = num_heads if num_kv_heads is None else num_kv_heads
    d_vhead = d_head if d_vhead is None else d_vhead
    d_out = d_q if d_out is None else d_out
    which = "qkvo" if bias is True else ("" if bias is False else bias)
    shapes = {
        "q": (d_q, num_heads * d_head),
        "k": (d_k, h_kv * d_head),
        "v": (d_v, h_kv * d_vhead),
        "o": (num_heads * d_vhead, d_out),
    }
    out: dict[str, np.ndarray] = {}
    for name, (fan_in, fan_out) in shapes.items():
        bound = 1.0 / math.sqrt(max(fan_in, 1))
        out[f"w_{name}"] = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(dtype)
        if name in which:
            out[f"b_{name}"] = rng.uniform(-bound, bound, fan_out).astype(dtype)
    return out


def assert_close(
    got: Any, ref: Any, dtype: Any, label: str = "ref", tol: float | None = None
) -> float:
    """Checks dtype, shape and values (NaN positions must agree); returns the error measured."""
    got = np.asarray(got)
    ref = np.asarray(ref, dtype=np.float64)
    dtype = np.dtype(dtype)
    assert got.dtype == dtype, f"dtype {got.dtype}, expected {dtype}"
    assert got.shape == ref.shape, f"shape {got.shape}, expected {ref.shape}"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg="NaN positions differ")
    ok = ~np.isnan(ref)
    if not ok.any():
        return 0.0
    g, r = got[ok].astype(np.float64), ref[ok]
    np.testing.assert_array_equal(np.isinf(g), np.isinf(r), err_msg="Inf positions differ")
    fin = np.isfinite(r)
    g, r = g[fin], r[fin]
    if r.size == 0:
        return 0.0
    tol = TOL[dtype] if tol is None else tol
    scale = np.abs(r) + max(float(np.max(np.abs(r))), 1e-300)
    err = float(np.max(np.abs(g - r) / scale))
    key = (label, str(dtype))
    _MAX_ERR[key] = max(_MAX_ERR[key], err)
    assert err <= tol, f"normwise relative error {err:.3e} > {tol:.1e} ({label}, {dtype})"
    return err


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


@pytest.fixture
def mha_weights():
    """``make_mha_weights(rng, d_q, num_heads, d_head, **options)``."""
    return make_mha_weights


@pytest.fixture
def close():
    """``assert_close(got, ref, dtype, label="ref", tol=None)``."""
    return assert_close


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    if _MAX_ERR:
        terminalreporter.section("largest normwise relative errors measured")
        for (label, dt), err in sorted(_MAX_ERR.items()):
            terminalreporter.write_line(f"{label:>24s} {dt:>8s}: {err:.3e}")


# attnlab's warning for rows that boolean masks leave empty (UserWarning) is an error in this
# suite: a test that masks whole rows on purpose says so, with @pytest.mark.empty_rows or
# warn_empty_rows=False, or asserts the warning (pytest.warns).
EMPTY_ROWS_WARNINGS = ("have no key they may attend to", "nothing is pooled for them")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "empty_rows: the test masks whole rows on purpose; attnlab's warning for them is ignored",
    )
    for text in EMPTY_ROWS_WARNINGS:
        config.addinivalue_line("filterwarnings", f"error:.*{text}:UserWarning")


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    for item in items:
        if item.get_closest_marker("empty_rows"):
            for text in EMPTY_ROWS_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f"ignore:.*{text}:UserWarning"))


def numeric_grad(f: Any, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar ``f()`` with respect to ``x``, changed in place."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return g


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Largest error relative to the largest entry of ``b`` (absolute below 1, e.g. for b_k,
    whose true gradient is 0 as it cancels in the softmax); 0 for empty arrays."""
    if b.size == 0:
        return 0.0
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1.0))


def cpuinfo() -> tuple[str, set[str]]:
    """The vendor ("GenuineIntel", "AuthenticAMD") and the flags of the first CPU in
    /proc/cpuinfo; ("", set()) where there is none (not Linux)."""
    vendor, flags = "", set()
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return vendor, flags
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return vendor, flags


def in_fresh_process(code: str, **env_vars: str | None) -> str:
    """Runs ``code`` in a new interpreter that imports the same attnlab and these tests'
    modules, with the environment variables ``env_vars`` set (None: removed); fails with its
    output unless it exits 0, else returns its standard output. For measurements that are
    process-wide (resident memory, the garbage collector), which what earlier tests left running
    moves, and for choices made once per process (``ATTNLAB_*`` variables)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import attnlab

    here = Path(__file__).resolve().parent
    pkg = str(Path(attnlab.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here), pkg, env.get("PYTHONPATH")) if p)
    for name, value in env_vars.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=here, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def rerun_tests(test_file: str, selection: str, **env_vars: str) -> None:
    """The tests of ``test_file`` (a path) chosen by ``-k selection`` again in a pytest
    subprocess with the environment variables ``env_vars`` set (choices made once per process):
    all pass, none skipped."""
    import os
    import subprocess
    import sys

    here = Path(test_file)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", here.name, "-k",
         selection],
        check=False, env=dict(os.environ, **env_vars), cwd=here.parent, capture_output=True,
        text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-500:]


# The switches that turn AMX off and the VDPBF16PS kernel on (read once per process)
VDPBF16PS = {"ATTNLAB_AMX": "0", "ATTNLAB_AVX512_BF16": "1"}


def require_vdpbf16ps() -> None:
    """Skips unless the VDPBF16PS kernel runs with VDPBF16PS's switches (the CPU has
    AVX512-BF16), probed in a subprocess."""
    kernel = in_fresh_process(
        "import attnlab; print(attnlab.build_info()['bf16_kernel'])", **VDPBF16PS
    ).strip()
    if kernel != "avx512_bf16":
        pytest.skip(f"no AVX512-BF16 kernel here (bf16_kernel={kernel!r})")


def refuse_conversions(
    monkeypatch: Any, shapes: set[tuple[int, ...]], read: set[tuple[int, ...]] = frozenset()
) -> None:
    """Make any widening (``_half.widen``, ``_validate.widen``) or rounding (``_half.store``) in
    Python of an array of one of ``shapes`` fail, and any widening of one of ``read`` (arrays
    read as stored whose results are still rounded in Python: weights and their gradients): a
    path that reads half-precision arrays as stored makes none. ``monkeypatch.undo()`` lifts
    it."""
    import attnlab

    def refuse(real: Any, refused: set[tuple[int, ...]]) -> Any:
        def check(a: np.ndarray, *rest: Any) -> np.ndarray:
            # widen(a) converts; store(a, half) unless half is None or a's own dtype
            if a.shape in refused and (not rest or rest[0] not in (None, a.dtype)):
                raise AssertionError(f"an array of {a.shape} converted in Python")
            return real(a, *rest)

        return check

    for module in (attnlab._half, attnlab._validate):
        monkeypatch.setattr(module, "widen", refuse(module.widen, set(shapes) | set(read)))
    monkeypatch.setattr(attnlab._half, "store", refuse(attnlab._half.store, set(shapes)))
