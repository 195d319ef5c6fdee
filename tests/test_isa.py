"""Instruction-set variants: every variant this CPU supports computes the same numbers, an
unsupported or unknown ATTNLAB_ISA is a clear error, and build_info reports the choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import attnlab
from attnlab import _loader

PROBE = """
import numpy as np, attnlab
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 70, 12))
w = {n: rng.standard_normal((12, 12)) / 4 for n in ("w_q", "w_k", "w_v", "w_o")}
out = attnlab.multi_head_attention(x, num_heads=3, causal=True, **w)
ref = attnlab.reference.multi_head_attention(x, num_heads=3, causal=True, **w)
err = float(np.abs(out - ref).max())
assert err < 1e-12, err
print(attnlab.build_info()["isa"])
"""


def _run(isa: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ATTNLAB_ISA=isa)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)


def test_build_info_reports_the_variant_in_use():
    info = attnlab.build_info()
    for key in ("version", "isa", "compiler", "eigen_version", "num_threads", "available_isas"):
        assert key in info
    assert info["isa"] in info["available_isas"]
    assert info["isa"] == info["available_isas"][0] or os.environ.get("ATTNLAB_ISA")


@pytest.mark.parametrize("isa", _loader.available())
def test_every_supported_variant_matches_the_reference(isa):
    r = _run(isa)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == isa


def test_unknown_isa_is_a_clear_error():
    r = _run("sse9")
    assert r.returncode != 0
    assert "ATTNLAB_ISA" in r.stderr and "expected one of" in r.stderr


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_unsupported_or_missing_variant_is_a_clear_error(isa):
    if isa in _loader.available():
        pytest.skip(f"{isa} is supported and built here")
    r = _run(isa)
    assert r.returncode != 0
    assert "ATTNLAB_ISA" in r.stderr  # ImportError naming the variable, never SIGILL
    assert r.returncode == 1


# The comparison suites (forward and backward of every family against the float64 reference,
# finite differences and torch), run again in a subprocess on each other variant this CPU
# supports: the variant in use already ran them in this session.
SUITES = ("test_mha.py", "test_bilinear.py", "test_additive.py", "test_backward_mha.py",
          "test_backward_bilinear.py", "test_backward_additive.py", "test_rope.py")


@pytest.mark.parametrize("isa", _loader.available())
def test_comparison_suites_pass_on_every_supported_variant(isa):
    if isa == attnlab.build_info()["isa"]:
        pytest.skip(f"{isa} is the variant in use: the suites ran on it in this session")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATTNLAB_ISA=isa)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-p", "no:randomly", *SUITES], cwd=here, env=env, capture_output=True,
                       text=True, timeout=1200)
    tail = "\n".join(r.stdout.splitlines()[-15:])
    assert r.returncode == 0, f"ATTNLAB_ISA={isa}:\n{tail}\n{r.stderr[-2000:]}"
    assert " passed" in tail
