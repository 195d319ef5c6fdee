"""Instruction-set variants: one module (attnlab._core) holds every variant and picks one at
import; every variant this CPU supports computes the same numbers, an unsupported, unbuilt or
unknown ATTNLAB_ISA is a clear error, and build_info reports the choice. Under qemu's x86-64
emulator (when installed), CPUs without AVX2 / AVX-512 select the variant they can run."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

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
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_build_info_reports_the_variant_in_use():
    info = attnlab.build_info()
    for key in (
        "version",
        "isa",
        "compiler",
        "eigen_version",
        "num_threads",
        "available_isas",
        "built_isas",
        "compiled_for",
        "cpu_features",
    ):
        assert key in info
    assert info["isa"] in info["available_isas"]
    assert info["isa"] == info["available_isas"][0] or os.environ.get("ATTNLAB_ISA")
    assert set(info["available_isas"]) <= set(info["built_isas"])
    assert info["isa"] == _loader.core.ISA


def test_one_module_holds_every_variant():
    pkg = Path(attnlab.__file__).parent
    assert not list(pkg.glob("_core_*")), "stale per-ISA modules next to attnlab._core"
    assert len(list(pkg.glob("_core.*"))) >= 1
    built = attnlab.build_info()["built_isas"]
    # `pip install .` and the wheels build every variant of the platform (ATTNLAB_ISAS narrows a
    # developer build; the sanitizer build has one)
    if os.environ.get("ATTNLAB_SANITIZED") or os.environ.get("ATTNLAB_ISAS"):
        return
    assert "generic" in built
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert {"generic", "avx2", "avx512"} <= set(built), built


def test_the_variant_needs_what_the_cpu_reports():
    feats = attnlab.build_info()["cpu_features"]
    avail = _loader.available()
    if "avx2" in avail:
        assert all(feats[f] for f in ("avx", "avx2", "fma", "bmi2", "os_avx"))
    if "avx512" in avail:
        assert all(feats[f] for f in ("avx512f", "avx512bw", "avx512vl", "os_avx512"))


def _proc_cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def test_the_cpu_is_named_as_the_kernel_reports_it():
    info = attnlab.build_info()
    proc = _proc_cpuinfo()
    if "vendor_id" not in proc or platform.machine().lower() not in ("x86_64", "amd64"):
        assert info["cpu"] == "unknown (not x86-64)" or info["cpu_vendor"]
        return
    # Linux prints cpuid's displayed family and model in decimal
    assert info["cpu_vendor"] == proc["vendor_id"]
    assert info["cpu_family"] == int(proc["cpu family"])
    assert info["cpu_model"] == int(proc["model"])
    assert f"family 0x{info['cpu_family']:02x}, model 0x{info['cpu_model']:02x}" in info["cpu"]


@pytest.mark.parametrize(
    "vendor, family, model, avx512, name",
    [
        ("AuthenticAMD", 0x19, 0x01, False, "AMD Zen 3 (family 0x19, model 0x01)"),
        ("AuthenticAMD", 0x19, 0x11, True, "AMD Zen 4 (family 0x19, model 0x11)"),
        ("AuthenticAMD", 0x1A, 0x02, True, "AMD Zen 5 (family 0x1a, model 0x02)"),
        ("AuthenticAMD", 0x15, 0x02, False, "AMD (family 0x15, model 0x02)"),
        ("GenuineIntel", 0x06, 0x8F, True, "Intel Sapphire Rapids (family 0x06, model 0x8f)"),
        ("GenuineIntel", 0x06, 0xCF, True, "Intel Emerald Rapids (family 0x06, model 0xcf)"),
        ("GenuineIntel", 0x06, 0x9A, False, "Intel (family 0x06, model 0x9a)"),
        ("GenuineIntel", 0x0F, 0x8F, False, "Intel (family 0x0f, model 0x8f)"),
        ("", 0, 0, False, "unknown (not x86-64)"),
    ],
)
def test_cpu_kinds_are_named_from_cpuid(vendor, family, model, avx512, name):
    assert attnlab._cpu_kind(vendor, family, model, avx512) == name


@pytest.mark.parametrize("isa", _loader.available())
def test_every_supported_variant_matches_the_reference(isa):
    r = _run(isa)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == isa


def test_unknown_isa_is_a_clear_error():
    r = _run("sse9")
    assert r.returncode != 0
    assert "ATTNLAB_ISA" in r.stderr and "expected one of" in r.stderr


@pytest.mark.parametrize("isa", ["avx2", "avx512", "native"])
def test_unsupported_or_missing_variant_is_a_clear_error(isa):
    if isa in _loader.available():
        pytest.skip(f"{isa} is supported and built here")
    r = _run(isa)
    assert r.returncode == 1  # ImportError naming the variable, never SIGILL
    assert "ImportError" in r.stderr and "ATTNLAB_ISA" in r.stderr
    assert ("does not support it" in r.stderr) or ("was not built" in r.stderr)


QEMU = shutil.which("qemu-x86_64-static") or shutil.which("qemu-x86_64")


def _emulated(cpu: str, isa: str) -> subprocess.CompletedProcess[str]:
    assert QEMU is not None
    # One thread each (attnlab, OpenBLAS): what is checked here is the choice of variant.
    env = dict(os.environ, ATTNLAB_ISA=isa, ATTNLAB_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [QEMU, "-cpu", cpu, sys.executable, "-c", PROBE]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
    if r.returncode < 0:
        # Killed by a signal: what runs under an emulated CPU does not depend on the host, so
        # an instruction that CPU lacks faults again, while qemu 7.2 on a Zen 5 host once died
        # and did not. A second death fails the test.
        first = r.stderr[-500:]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
        if r.returncode == 0:
            warnings.warn(
                f"qemu -cpu {cpu}: the first run died, the second passed: {first}", stacklevel=2
            )
    return r


# Older CPUs, emulated: the whole Python process runs under qemu-user with the CPU model given,
# so cpuid reports what that CPU has and any AVX instruction would be SIGILL (qemu has no
# AVX-512). Nehalem: SSE4.2, no AVX; Haswell: AVX2 + FMA, no AVX-512.
@pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="needs qemu-x86_64 (Debian: qemu-user-static) on x86-64",
)
@pytest.mark.parametrize(
    ("cpu", "best", "refused"),
    [("Nehalem", "generic", ["avx2", "avx512"]), ("Haswell", "avx2", ["avx512"])],
)
def test_emulated_older_cpus_select_what_they_can_run(cpu, best, refused):
    r = _emulated(cpu, "")
    assert r.returncode == 0, r.stderr[-2000:]
    if best not in _loader.core.BUILT_ISAS:  # a narrowed developer build (ATTNLAB_ISAS)
        best = "generic"
    assert r.stdout.strip().splitlines()[-1] == best
    for isa in refused:
        r = _emulated(cpu, isa)
        assert r.returncode == 1, (isa, r.returncode, r.stderr[-2000:])
        assert "ATTNLAB_ISA" in r.stderr and "does not support it" in r.stderr


# The comparison suites (forward and backward of every family against the float64 reference,
# finite differences and torch), run again in a subprocess on each other variant this CPU
# supports: the variant in use already ran them in this session.
SUITES = (
    "test_mha.py",
    "test_bilinear.py",
    "test_additive.py",
    "test_backward_mha.py",
    "test_backward_bilinear.py",
    "test_backward_additive.py",
    "test_rope.py",
)


@pytest.mark.parametrize("isa", _loader.available())
def test_comparison_suites_pass_on_every_supported_variant(isa):
    if isa == attnlab.build_info()["isa"]:
        pytest.skip(f"{isa} is the variant in use: the suites ran on it in this session")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATTNLAB_ISA=isa)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            *SUITES,
        ],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=1200,
    )
    tail = "\n".join(r.stdout.splitlines()[-15:])
    assert r.returncode == 0, f"ATTNLAB_ISA={isa}:\n{tail}\n{r.stderr[-2000:]}"
    assert " passed" in tail
