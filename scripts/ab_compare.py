"""The command line the timing scripts share (small_calls.py, kernel_ab.py): time the cases in
this process, or compare two trees, each case in its own process, the trees alternately over
several rounds, keeping the minimum per tree (alternation and minima keep a shared machine's
other load out of the comparison as far as they can)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence


def main(
    doc: str,
    script: str,
    cases: Sequence[str],
    time_case: Callable[[str], float],
    unit: str,
    rounds: int,
) -> int:
    """Parse the arguments (CASE ..., --compare A B, --rounds) and run; ``time_case(name)``
    returns one case's time in ``unit``; ``script`` runs one case when called with its name."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("cases", nargs="*", metavar="CASE", help=", ".join(cases))
    p.add_argument("--compare", nargs=2, metavar="PYTHONPATH")
    p.add_argument("--rounds", type=int, default=rounds)
    args = p.parse_args()
    args.cases = args.cases or list(cases)
    for name in args.cases:
        if name not in cases:
            p.error(f"unknown case {name!r}: expected one of {', '.join(cases)}")
    width = max(12, *(len(n) for n in args.cases))
    if not args.compare:
        for name in args.cases:
            print(f"{name:{width}s} {time_case(name):10.2f} {unit}", flush=True)
        return 0
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for name in args.cases:
            for tree in args.compare:
                env = {**os.environ, "PYTHONPATH": tree}
                out = subprocess.run(
                    [sys.executable, script, name],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if out.returncode:
                    sys.stderr.write(out.stderr)
                    return 1
                t = float(out.stdout.split()[1])
                best[name, tree] = min(t, best.get((name, tree), t))
    a, b = args.compare
    print(f"{'case':{width}s} {f'A ({unit})':>10s} {f'B ({unit})':>10s}  B/A   A = {a}, B = {b}")
    for name in args.cases:
        ta, tb = best[name, a], best[name, b]
        print(f"{name:{width}s} {ta:10.2f} {tb:10.2f}  {tb / ta:.2f}")
    return 0
