"""The machine's float32 peak: the module's FMA kernel (the denominator of every "share of
peak"), and OpenBLAS's sgemm in a process of its own, the check that the peak is right (a GEMM
cannot beat the FMA units it runs on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from .._loader import core

__all__ = ["fma_peak", "sgemm_gflops", "worker_env"]


def fma_peak(quick: bool) -> dict[str, Any]:
    """The float32 FMA peak of the variant in use, all pool threads, in GFLOP/s.

    Each thread's rate is taken over the CPU time it ran (where the system has a per-thread CPU
    clock): on a machine shared with other processes a thread is descheduled for part of the
    wall time, and its wall-clock rate then understates what its core can do (a GEMM timed in a
    quieter moment would beat such a "peak"). The peak is the sum of the threads' rates, which
    assumes one thread per core (the default thread count: the CPUs available).

    Parameters
    ----------
    quick : bool
        Three bursts of 0.1 s instead of five of 0.25 s.

    Returns
    -------
    dict
        ``gflops`` (the peak: the best burst's sum of per-thread rates), ``per_thread`` (that
        burst's rate of each thread), ``clock`` ("cpu", or "wall" without a per-thread clock),
        ``wall_gflops`` (the best burst's flops over its wall time: what the machine gave this
        process) and ``bursts`` (every burst's peak).
    """
    seconds, bursts = (0.1, 3) if quick else (0.25, 5)
    runs = [core.fma_peak(seconds) for _ in range(bursts)]
    cpu = all(r > 0 for run in runs for r in run[2])
    per = [list(run[2] if cpu else run[1]) for run in runs]
    sums = [sum(p) for p in per]
    best = max(range(bursts), key=lambda i: sums[i])
    return {
        "gflops": sums[best],
        "per_thread": per[best],
        "clock": "cpu" if cpu else "wall",
        "wall_gflops": max(run[0] for run in runs),
        "bursts": sums,
    }


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a benchmark subprocess limited to ``threads`` threads, whatever its
    runtime reads (OpenMP, OpenBLAS, MKL, XLA, attnlab)."""
    env = dict(os.environ)
    for var in (
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "ATTNLAB_NUM_THREADS",
    ):
        env[var] = str(threads)
    xla = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = (
        f"{xla} --xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"
        f" intra_op_parallelism_threads={threads}"
    ).strip()
    # the parent's own import path (e.g. PYTHONPATH=python in a source tree) for the child
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


def memory_bandwidth(threads: int, quick: bool) -> dict[str, Any] | None:
    """The machine's memory read bandwidth with ``threads`` threads (``peers_worker
    bandwidth``: OpenBLAS's sgemv over a matrix far larger than the caches), in a fresh
    process: the best GB/s of a few calls, or None when the subprocess failed."""
    return _worker(["bandwidth", "512" if quick else "1024"], threads, "5" if quick else "10")


def _worker(what: list[str], threads: int, repeat: str) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "attnlab._bench.peers_worker", *what, "--repeat", repeat]
    cmd += ["--threads", str(threads)]
    try:
        r = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=300, env=worker_env(threads)
        )
        out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
        return out
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def sgemm_gflops(threads: int, quick: bool) -> dict[str, Any] | None:
    """NumPy's float32 matmul (OpenBLAS) on a large square matrix, ``threads`` threads, in a
    fresh process (its spinning threads then disturb nothing else): the best rate of a few calls,
    or None when the subprocess failed."""
    return _worker(["sgemm", "1024" if quick else "2048"], threads, "5" if quick else "10")
