"""The stress run: 10,000 random calls of every public function in a
separate process (``fuzz_stress.py``), valid and broken mixed, seeded.

The child prints one JSON line of counts. The process must exit 0 (a segfault, abort or
sanitizer report would kill it: the exit status is the crash detector), and every call must
have ended as it should: a valid call agreeing with its oracle (the float64 reference, or
finite differences for gradients) at the documented tolerance, a result equal to the
contiguous call for layout variants, the float32 call's bits rounded for half-precision
variants, the forward's output and the backward's gradients for ``vjp`` variants, a
``ValueError``/``TypeError`` naming the argument for broken calls
(``MemoryError`` for impossible sizes), never another exception.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("fuzz_stress.py")
# ATTNLAB_FUZZ_CALLS: fewer calls for slow instrumented runs (scripts/sanitize.sh sets 2,000)
CALLS = int(os.environ.get("ATTNLAB_FUZZ_CALLS", "10000"))


def _run(calls: int, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **env_extra)
    # the child imports attnlab exactly as this process did (installed, or via PYTHONPATH)
    import attnlab

    pkg_root = str(Path(attnlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", str(calls)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )


def test_a_crash_is_seen_by_its_exit_status() -> None:
    """The harness itself: a child that dies (here by abort, as a segfault or a sanitizer
    would) gives a non-zero status and no report."""
    proc = _run(50, ATTNLAB_FUZZ_ABORT_AT="20")
    assert proc.returncode != 0
    assert not proc.stdout.strip()


def test_ten_thousand_random_calls_never_crash() -> None:
    proc = _run(CALLS)
    assert proc.returncode == 0, (
        f"fuzz process died with status {proc.returncode}\n{proc.stderr[-4000:]}"
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = {k: v for k, v in report.items() if k != "problems"}
    print("\nfuzz:", json.dumps(summary, sort_keys=True))
    assert report["calls"] == CALLS
    # every valid call was checked against its oracle (reference / finite differences), every
    # half-precision one against the float32 call (bit for bit)
    assert report["checked"] == report["kind:valid"]
    assert report.get("half_checked", 0) == report.get("kind:half", 0)
    assert report.get("vjp_checked", 0) == report.get("kind:vjp", 0)
    problems = "\n".join(report["problems"])
    assert report.get("unexpected", 0) == 0, problems
    assert report.get("wrong", 0) == 0, problems
    assert report.get("unnamed", 0) == 0, problems
    assert report.get("accepted_invalid", 0) == 0, problems
    errors = sum(v for k, v in report.items() if k.startswith("error:"))
    assert report["result"] + errors == CALLS
    if CALLS >= 1000:  # every kind of call and every family was exercised
        assert all(
            report.get(f"kind:{k}", 0) > 0
            for k in ("valid", "layout", "invalid", "nonfinite", "huge", "half", "vjp")
        )
        assert sum(1 for k in report if k.startswith("family:")) == 14
