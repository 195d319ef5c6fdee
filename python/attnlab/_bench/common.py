"""Timing helpers shared by the benchmark families.

Every timing is a median of repeated runs after a warm-up; implementations being compared are
interleaved (round-robin) in the same process so that machine noise hits them alike, each timed
call preceded by an untimed one of the same implementation (see ``interleaved``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from math import comb
from typing import Any

import numpy as np

__all__ = [
    "APART",
    "NOISY",
    "REFERENCE_MIB",
    "Row",
    "Timing",
    "as_numpy",
    "gradient_error",
    "interleaved",
    "median_interval",
    "output_errors",
    "paired",
    "reference_fits",
    "relative_error",
    "target",
    "try_torch",
]

NOISY = 1.5  # a timing whose slowest run took this many times its fastest is flagged


class Timing(float):
    """A median time in milliseconds that also carries ``spread``: the slowest timed run over
    the fastest (1.0 for a steady machine). It is a float everywhere else (tables, JSON)."""

    spread: float

    def __new__(cls, ms: float, spread: float = 1.0) -> Timing:
        t = super().__new__(cls, ms)
        t.spread = float(spread)
        return t


@dataclass
class Row:
    """One line of the benchmark table."""

    family: str  # "mha", "bilinear", "additive", ...
    case: str  # a short label, e.g. "ViT-S fwd fp32"
    shape: str  # e.g. "B=8 n=197 d=384 h=6"
    impl: str  # "attnlab", "reference", "torch", ...
    ms: float  # median milliseconds
    flops: float = 0.0  # floating-point operations of one call (2 per multiply-add)
    baseline: str | None = None  # impl the ratio is taken against (same family/case)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gflops(self) -> float:
        return self.flops / (self.ms * 1e-3) / 1e9 if self.ms > 0 and self.flops else 0.0


def target(name: str, value: float, goal: str, met: bool) -> dict[str, Any]:
    """One line of "Targets, this run": what, the measured value, the goal and whether it is
    met."""
    return {"target": name, "value": round(value, 3), "goal": goal, "met": bool(met)}


# Implementations built on NumPy's BLAS: OpenBLAS threads spin for a while after a call, which
# slowed whatever ran next in the same process. They are timed apart, after the
# others, so that they disturb nobody.
APART = ("reference", "numpy-blas")
# Seconds of untimed calls of an implementation before its timed one, in a round of several:
# the previous one's threads (torch's OpenMP pool) keep spinning for a while after its call and
# slow whatever runs among them (docs/performance.md, "Other runtimes' spinning threads").
SETTLE = 0.02


def interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    repeat: int = 7,
    warmup: int = 1,
    min_time: float = 0.0,
    max_time: float = 30.0,
) -> dict[str, Timing]:
    """Median milliseconds of each callable (a :class:`Timing`, with its spread), timed
    round-robin.

    ``repeat`` rounds (more, up to ``max_time`` seconds in all, while a round is shorter than
    ``min_time``); the first ``warmup`` calls of each are not timed. Each timed call follows
    untimed calls of the same implementation, at least one and for at least :data:`SETTLE`
    seconds (torch's OpenMP threads spin for a while after a call). Implementations named in
    ``APART`` are timed after the others, on their own.
    """
    main = {k: f for k, f in fns.items() if k not in APART}
    out = _round_robin(main, repeat, warmup, min_time, max_time) if main else {}
    for k, f in fns.items():
        if k in APART:
            out.update(_round_robin({k: f}, repeat, warmup, min_time, max_time))
    return {k: out[k] for k in fns}


def _round_robin(
    fns: dict[str, Callable[[], Any]], repeat: int, warmup: int, min_time: float, max_time: float
) -> dict[str, Timing]:
    times = _rounds(fns, repeat, warmup, min_time, max_time, settle=SETTLE)
    return {
        k: Timing(float(np.median(v)) * 1e3, max(v) / min(v) if min(v) > 0 else 1.0)
        for k, v in times.items()
    }


def _rounds(
    fns: dict[str, Callable[[], Any]],
    repeat: int,
    warmup: int,
    min_time: float,
    max_time: float,
    alternate: bool = False,
    settle: float = 0.0,
) -> dict[str, list[float]]:
    """Seconds of each callable, one call each per round (``alternate``: the order reversed
    every other round), each timed call after untimed ones for ``settle`` seconds (at least
    one); see :func:`interleaved`."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    rounds = 0
    while True:
        order = list(fns.items())
        for k, f in order[::-1] if alternate and rounds % 2 else order:
            if len(fns) > 1:  # untimed: lets the previous implementation's threads go quiet
                until = time.perf_counter() + settle
                f()
                while time.perf_counter() < until:
                    f()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
        rounds += 1
        elapsed = time.perf_counter() - start
        if rounds >= repeat and (elapsed >= min_time or elapsed >= max_time):
            break
        if elapsed >= max_time and rounds >= 3:
            break
    return times


def paired(
    a: Callable[[], Any],
    b: Callable[[], Any],
    *,
    repeat: int = 9,
    min_time: float = 0.0,
    max_time: float = 30.0,
) -> tuple[list[float], list[float]]:
    """Seconds of ``a`` and of ``b`` in rounds: each round times both back to back, which goes
    first alternating from round to round (so that neither always follows the other), each
    timed call preceded by an untimed one of the same callable. At least ``repeat`` rounds, more
    while they took less than ``min_time`` seconds in all, up to ``max_time``; one warm-up call
    of each first. Round ``i``'s two times make the pair whose ratio :func:`median_interval`
    summarises: the machine's slow spells hit both calls of a pair alike."""
    times = _rounds({"a": a, "b": b}, repeat, 1, min_time, max_time, alternate=True)
    return times["a"], times["b"]


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median of ``values`` and a distribution-free interval that holds the true median
    with probability at least ``level`` (0.9, 0.95 or 0.99): the j-th smallest and j-th largest
    values, j the largest rank whose binomial(n, 1/2) tail leaves that coverage; the smallest
    and the largest when n is too small for any (n < 6 at 95%)."""
    alphas = {0.9: Fraction(1, 10), 0.95: Fraction(1, 20), 0.99: Fraction(1, 100)}
    if level not in alphas:
        raise ValueError(f"level: expected 0.9, 0.95 or 0.99, got {level!r}")
    v = np.sort(np.asarray(values, dtype=np.float64))
    n = len(v)
    if n == 0:
        raise ValueError("values: expected at least one, got none")
    # coverage of [v_(j), v_(n+1-j)] (1-based) is 1 - 2 P(X <= j - 1), X ~ binomial(n, 1/2)
    j, tail = 0, 0
    while True:
        tail += comb(n, j)  # 2^n P(X <= j)
        if 2 * tail > alphas[level] * 2**n:
            break
        j += 1
    lo, hi = (v[j - 1], v[n - j]) if j >= 1 else (v[0], v[-1])
    return float(np.median(v)), float(lo), float(hi)


def try_torch(threads: int) -> Any:
    """torch, set to ``threads`` threads, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return torch


def relative_error(out: np.ndarray, ref: np.ndarray, floor: float = 1e-300) -> float:
    """Normwise relative difference ``||out - ref|| / max(||ref||, floor)`` in float64 (inf when
    the shapes differ or the output is not finite)."""
    if out.shape != ref.shape:
        return float("inf")
    o, r = out.astype(np.float64), ref.astype(np.float64)
    err = float(np.linalg.norm(o - r) / max(float(np.linalg.norm(r)), floor))
    return err if np.isfinite(err) else float("inf")


def gradient_error(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> tuple[float, str]:
    """The worst normwise difference over the arrays of a training step (the output and every
    gradient), and its name. Each array is measured against its own norm, or against 1e-3 of the
    norm of all of ``ref`` when that is larger: the key bias's gradient is zero in exact
    arithmetic (a shift shared by every key leaves the softmax unchanged), so its rounding noise
    has no norm of its own to be relative to. inf when a name is missing."""
    if set(got) != set(ref):
        missing = sorted(set(got) ^ set(ref))
        return float("inf"), ", ".join(missing)
    floor = 1e-3 * float(np.sqrt(sum(np.sum(r.astype(np.float64) ** 2) for r in ref.values())))
    worst, name = 0.0, ""
    for k, r in ref.items():
        err = relative_error(got[k], r, floor)
        if not err <= worst:  # NaN and inf too
            worst, name = err, k
    return worst, name


# An output's error is measured only where the float64 reference's largest arrays take at most
# this many MiB: its temporaries come to many such arrays.
REFERENCE_MIB = 64


def reference_fits(*elements: int) -> bool:
    """Whether float64 arrays of these element counts fit in ``REFERENCE_MIB``: the largest
    arrays of a reference (one head's scores for the NumPy attention reference, all heads' for
    torch autograd, the activations of the additive families)."""
    return 8 * sum(elements) <= REFERENCE_MIB * 2**20


def as_numpy(out: Any) -> np.ndarray:
    """An implementation's output as a NumPy array (torch tensors included)."""
    if hasattr(out, "detach"):
        out = out.detach().numpy()
    return np.asarray(out)


def output_errors(fns: dict[str, Callable[[], Any]], ref: np.ndarray) -> dict[str, float]:
    """:func:`relative_error` of each implementation's output (one untimed call) against the
    float64 reference's output ``ref``."""
    return {k: relative_error(as_numpy(f()), ref) for k, f in fns.items()}
