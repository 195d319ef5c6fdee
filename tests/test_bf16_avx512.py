"""precision="bf16" on the VDPBF16PS kernel (AVX512-BF16 without AMX): the same rounding as the
AMX kernel and the emulation (q, k, v and P rounded to bfloat16, float32 sums and softmax
statistics), so it agrees with both to the order of the float32 sums, within test_bf16.py's
2**-8 max|v| and test_half.py's float64 bound. ATTNLAB_AMX=0 turns AMX off, ATTNLAB_AVX512_BF16=1
runs the VDPBF16PS kernel wherever the CPU has AVX512-BF16 (by default it runs on AMD only) and
=0 the emulation: each kernel runs in its own process, as those switches are read once."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attnlab
from attnlab import reference
from attnlab._bench.accuracy import UNIT_ROUNDOFF, error_bound, logit_scale
from attnlab.reference._mha import _bf16
from conftest import cpuinfo, make_mha_weights
from test_bf16 import SDPA_BF16_CASES, SHAPES, _logit_error_bound
from test_bf16 import _sdpa_case as _bf16_case
from test_half import SDPA_SHAPES, _rel
from test_half import _sdpa_case as _half_case

# Shapes at the kernel's edges: head widths off the 32-feature chunks, value widths of 1, 3 and
# 6 column tiles, query counts off the 8-row register blocks, key counts off the 32-key chunks
# and across 128-key blocks, grouped-query heads, sinks with a window.
EDGE_CASES = [
    ((1, 2, 37, 72), (1, 2, 129, 72), {"d_v": 96}),
    ((2, 4, 100, 8), (2, 1, 33, 8), {"causal": True, "d_v": 20}),
    ((1, 3, 65, 130), (1, 3, 257, 130), {"causal": "bottom_right", "sinks": [0.1, 2.0, -3.0]}),
    ((1, 2, 200, 64), (1, 2, 1000, 64), {"window": (100, 3), "scale": 0.05}),
    ((1, 1, 9, 1), (1, 1, 300, 1), {"d_v": 1}),
]
KERNELS = {
    "avx512_bf16": {"ATTNLAB_AMX": "0", "ATTNLAB_AVX512_BF16": "1"},
    "emulated": {"ATTNLAB_AMX": "0", "ATTNLAB_AVX512_BF16": "0"},
}

RUNNER = """
import pickle, sys, numpy as np, attnlab
from attnlab._loader import core
def linear(x, w, b):
    y = np.empty((x.shape[0], w.shape[1]), np.float32)
    core.linear_forward(x, w, b, y, True)
    return y
fns = {"sdpa": attnlab.scaled_dot_product_attention, "mha": attnlab.multi_head_attention,
       "mha_backward": attnlab.multi_head_attention_backward, "linear": linear,
       "additive_attention": attnlab.additive_attention,
       "separable_attention": attnlab.separable_attention}
with open(sys.argv[1], "rb") as f:
    calls = pickle.load(f)
outs = [fns[name](*args, **kw) for name, args, kw in calls]
with open(sys.argv[1], "wb") as f:
    pickle.dump([attnlab.build_info()["bf16_kernel"], outs], f)
"""


def _run(env: dict[str, str], calls: list[Any], path: Path) -> tuple[str, list[Any]]:
    """The bf16 kernel's name and the results of ``calls`` ((name, args, kwargs): "sdpa",
    "mha", "mha_backward" or "linear") in a process with ``env`` set."""
    path.write_bytes(pickle.dumps(calls))
    pkg = str(Path(attnlab.__file__).resolve().parents[1])
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, full.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, "-c", RUNNER, str(path)], env=full, check=True, timeout=600)
    kernel, outs = pickle.loads(path.read_bytes())
    return kernel, outs


def _sdpa_calls(cases: list[tuple[Any, ...]]) -> list[Any]:
    return [("sdpa", (q, k, v), dict(kw, precision="bf16")) for q, k, v, kw in cases]


def _cases() -> list[tuple[str, tuple[Any, ...]]]:
    """(id, (q, k, v, options)) for test_bf16.py's cases, test_half.py's shapes and the edges."""
    out = []
    for q_shape, k_shape, options in SDPA_BF16_CASES + EDGE_CASES:
        args = _bf16_case(q_shape, k_shape, dict(options), seed=sum(q_shape) + len(options))
        out.append((f"bf16-{q_shape}-{k_shape}-{sorted(options)}", args))
    for shape in SDPA_SHAPES:
        for scale_qk in (1.0, 2.0):
            a, kw = _half_case(shape, scale_qk)
            out.append((f"half-{shape[:7]}-{sorted(kw)}-{scale_qk}", (a["q"], a["k"], a["v"], kw)))
    return out


CASES = _cases()


def _linear_cases() -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """test_bf16.py's GEMM shapes and edges: input widths off the 32-feature blocks and across
    256-feature passes, outputs off the 16-column vectors and over 8 column blocks, no bias."""
    out = []
    for i, (m, k, n) in enumerate(SHAPES + [(1576, 768, 768), (70, 290, 300), (33, 513, 40)]):
        rng = np.random.default_rng(100 + i)
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((k, n)).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32) if i % 2 else None
        out.append((x, w, b))
    return out


LINEAR_CASES = _linear_cases()
# (x, weights, options) for multi_head_attention: test_bf16.py's options and a ViT-like layer
MHA_CASES = [
    (
        np.random.default_rng(5 + i).standard_normal((2, n, d)).astype(np.float32),
        make_mha_weights(np.random.default_rng(50 + i), d, h, d // h, dtype=np.float32, **wkw),
        dict(kw, num_heads=h),
    )
    for i, (n, d, h, wkw, kw) in enumerate(
        [
            (40, 64, 4, {}, {}),
            (40, 64, 4, {}, {"causal": True, "rope_theta": 1e4}),
            (40, 64, 4, {"num_kv_heads": 2}, {"num_kv_heads": 2}),
            (197, 384, 6, {}, {}),
        ]
    )
]
# (output gradient, x, weights, options) for multi_head_attention_backward
GRADS = [
    (np.random.default_rng(60 + i).standard_normal(x.shape).astype(np.float32), x, w, kw)
    for i, (x, w, kw) in enumerate(MHA_CASES[:3])
]


def _context(out: Any, kw: dict[str, Any]) -> np.ndarray:
    """The attention output of a call (without its weights when it returned them)."""
    return out[0] if kw.get("return_weights") else out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every case's output on each kernel (one process each); skips without AVX512-BF16."""
    tmp = tmp_path_factory.mktemp("bf16_avx512")
    calls = _sdpa_calls([args for _, args in CASES])
    calls += [("linear", args, {}) for args in LINEAR_CASES]
    calls += [("mha", (x,), dict(w, **kw, precision="bf16")) for x, w, kw in MHA_CASES]
    calls += [("mha_backward", (g, x), dict(w, **kw, precision="bf16")) for g, x, w, kw in GRADS]
    outs = {}
    for name, env in KERNELS.items():
        kernel, results = _run(env, calls, tmp / f"{name}.pkl")
        if kernel != name:
            pytest.skip(f"no AVX512-BF16 kernel here: with {env} the bf16 kernel is {kernel!r}")
        n, m, k = len(CASES), len(LINEAR_CASES), len(MHA_CASES)
        outs[name], outs[f"{name}-linear"] = results[:n], results[n : n + m]
        outs[f"{name}-mha"] = results[n + m : n + m + k]
        outs[f"{name}-grads"] = results[n + m + k :]
    return outs


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_vdpbf16ps_agrees_with_the_emulation_and_the_references(runs, index):
    """Against the emulation and the reference with the same rounding: within 2**-8 max|v| (a
    probability may round to the neighbouring bfloat16 where the sums' order differs); against
    the exact float64 reference: test_bf16.py's elementwise bound and test_half.py's normwise
    error bound."""
    q, k, v, kw = CASES[index][1]
    got, emulated = runs["avx512_bf16"][index], runs["emulated"][index]
    if kw.get("return_weights"):
        (got, w_got), (emulated, w_emulated) = got, emulated
        np.testing.assert_array_equal(w_got, w_emulated)  # the weights path is the emulation
    assert got.dtype == np.float32
    vmax = float(np.abs(v).max())
    tol = 2.0**-8 * vmax * 1.01 + 1e-5
    assert np.abs(got - emulated).max() <= tol
    same = reference.scaled_dot_product_attention(q, k, v, precision="bf16", **kw)
    exact = reference.scaled_dot_product_attention(q, k, v, **kw)
    if kw.get("return_weights"):
        same, exact = same[0], exact[0]
    assert np.abs(got - same).max() <= tol
    scale = kw.get("scale", 1 / np.sqrt(q.shape[-1]))
    e = _logit_error_bound(q, k, scale)
    assert np.abs(got - exact).max() <= (np.expm1(2 * e) + 2 * 2.0**-8) * vmax * 1.01 + 1e-5
    if "scale" not in kw:
        rho = logit_scale(q, k)
        length = max(k.shape[-2], q.shape[-1], v.shape[-1])
        assert _rel(got, exact) <= error_bound(UNIT_ROUNDOFF["bfloat16"], rho, length)


def test_vdpbf16ps_really_runs_and_falls_back_where_it_must(runs):
    """Where the kernel runs its sums differ in order from the emulation's (some output differs
    in its last bits); the weights path and the decode path (few queries per kv head) are the
    emulation's, bit for bit."""
    differs = fallback = 0
    for (case_id, (q, k, _, kw)), out, out_emulated in zip(
        CASES, runs["avx512_bf16"], runs["emulated"], strict=True
    ):
        got, emulated = _context(out, kw), _context(out_emulated, kw)
        # decode.hpp's use_decode: up to 16 query rows per kv head against 1024 keys or more
        decode = q.shape[-2] * (q.shape[-3] // k.shape[-3]) <= 16 and k.shape[-2] >= 1024
        if kw.get("return_weights") or decode:
            np.testing.assert_array_equal(got, emulated, err_msg=case_id)
            fallback += 1
        elif q.shape[-2] * k.shape[-2] * q.shape[-1] >= 64 * 64 * 16:
            differs += not np.array_equal(got, emulated)
    assert fallback >= 2 and differs >= 5


def test_nonfinite_values_take_the_emulation(tmp_path):
    """A value row holding NaN or Inf: the kernel hands the call to the emulation (only the
    queries that may see the row get NaN/Inf), bit for bit."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 2, 64, 32)).astype(np.float32) for _ in range(3))
    v[0, 1, 40, 3] = np.nan
    v[0, 0, 10, 0] = np.inf
    cases = _sdpa_calls([(q, k, v, {"causal": True})])
    kernel, (got,) = _run(KERNELS["avx512_bf16"], cases, tmp_path / "v.pkl")
    if kernel != "avx512_bf16":
        pytest.skip(f"no AVX512-BF16 kernel here: with {KERNELS['avx512_bf16']} it is {kernel!r}")
    _, (emulated,) = _run(KERNELS["emulated"], cases, tmp_path / "e.pkl")
    np.testing.assert_array_equal(got, emulated)
    assert np.isnan(got[0, 1, 40:, 3]).all() and not np.isnan(got[0, 1, :40]).any()


def test_vdpbf16ps_agrees_with_amx(runs):
    """Both kernels pack the same bf16 operands and run the same softmax; only the order of
    the float32 sums differs: within 2**-8 max|v| of each other."""
    if attnlab.build_info()["bf16_kernel"] != "amx":
        pytest.skip("this CPU has no usable AMX to compare with")
    for (case_id, (q, k, v, kw)), out in zip(CASES, runs["avx512_bf16"], strict=True):
        got = _context(out, kw)
        amx = _context(attnlab.scaled_dot_product_attention(q, k, v, precision="bf16", **kw), kw)
        assert np.abs(got - amx).max() <= 2.0**-8 * float(np.abs(v).max()) * 1.01 + 1e-5, case_id


@pytest.mark.parametrize("index", range(len(LINEAR_CASES)))
def test_linear_vdpbf16ps_is_the_rounded_product_to_float32_sums(runs, index):
    """Against float64 of the bf16-rounded operands: elementwise within (K + 2) 2**-24 of
    |x| |w| + |b|, as test_bf16.py holds AMX and the emulation (so both agree within twice
    that); the sums' order differs from the emulation's (the kernel really ran)."""
    x, w, b = LINEAR_CASES[index]
    got, emulated = runs["avx512_bf16-linear"][index], runs["emulated-linear"][index]
    bias = np.zeros(w.shape[1]) if b is None else b
    exact = _bf16(x) @ _bf16(w) + bias
    bound = ((np.abs(_bf16(x)) @ np.abs(_bf16(w))) + np.abs(bias)) * (x.shape[1] + 2) * 2.0**-24
    assert got.dtype == np.float32
    assert np.all(np.abs(got - exact) <= bound)
    assert np.all(np.abs(emulated - exact) <= bound)
    if x.shape[1] >= 64 and x.shape[0] * w.shape[1] >= 1000:
        assert not np.array_equal(got, emulated)


@pytest.mark.parametrize("index", range(len(MHA_CASES)))
def test_mha_vdpbf16ps_within_its_bounds(runs, index):
    """test_bf16.py's bounds for multi_head_attention (projections and attention core on
    VDPBF16PS): within 2**-8 of the largest output of the reference with the same rounding,
    4 2**-8 of the exact one; and within 2**-8 of the emulation, not equal to it."""
    x, w, kw = MHA_CASES[index]
    got, emulated = runs["avx512_bf16-mha"][index], runs["emulated-mha"][index]
    same = reference.multi_head_attention(x, **w, **kw, precision="bf16")
    exact = reference.multi_head_attention(x, **w, **kw)
    scale = np.abs(exact).max()
    assert got.dtype == np.float32
    assert np.abs(got - same).max() <= 2.0**-8 * scale
    assert np.abs(got - exact).max() <= 4 * 2.0**-8 * scale
    assert np.abs(got - emulated).max() <= 2.0**-8 * scale
    assert not np.array_equal(got, emulated)  # other sums: the kernels really ran


def test_default_kernel_without_amx():
    """With AMX off and no ATTNLAB_AVX512_BF16: VDPBF16PS on AMD CPUs that have AVX512-BF16
    (on the Intel cores measured it is slower than the emulation), the emulation elsewhere."""
    if not Path("/proc/cpuinfo").exists() or attnlab.build_info()["isa"] != "avx512":
        pytest.skip("needs /proc/cpuinfo and the avx512 variant in use")
    vendor, flags = cpuinfo()
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_AVX512_BF16"}
    env["ATTNLAB_AMX"] = "0"
    pkg = str(Path(attnlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
    code = "import attnlab; print(attnlab.build_info()['bf16_kernel'])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    want = "avx512_bf16" if vendor == "AuthenticAMD" and "avx512_bf16" in flags else "emulated"
    assert out.stdout.strip() == want


@pytest.mark.parametrize("index", range(len(GRADS)))
def test_mha_backward_vdpbf16ps_within_its_bounds(runs, index):
    """Gradients over the VDPBF16PS forward projections: within test_bf16.py's 4 2**-8 of the
    exact float64 gradients' largest entry, and within that of the emulation's."""
    g, x, w, kw = GRADS[index]
    got, emulated = runs["avx512_bf16-grads"][index], runs["emulated-grads"][index]
    exact = attnlab.multi_head_attention_backward(
        g.astype(np.float64),
        x.astype(np.float64),
        **{k: v.astype(np.float64) for k, v in w.items()},
        **kw,
    )
    assert set(got) == set(exact)
    for name, gr in got.items():
        tol = 4 * 2.0**-8 * np.abs(exact[name]).max() + 1e-6
        assert gr.dtype == np.float32
        assert np.abs(gr - exact[name]).max() <= tol, name
        assert np.abs(gr - emulated[name]).max() <= tol, name
