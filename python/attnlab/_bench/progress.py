"""Progress of a long benchmark run, on stderr: the step running, each step as it finishes and
an estimate of the time left (from the mean time of the steps done). Quiet unless asked: the
command turns it on when stdout is a terminal, or with ``--progress``."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``total`` steps; :meth:`step` names the one starting and ends the one before."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self.t0 = time.perf_counter()
        self.current: str | None = None

    def _left(self) -> str:
        if self.done == 0:
            return ""
        per = (time.perf_counter() - self.t0) / self.done
        left = per * (self.total - self.done)
        return f", about {left / 60:.1f} min left" if left >= 60 else f", about {left:.0f} s left"

    def step(self, what: str) -> None:
        """``what`` starts (the step before it, if any, is done)."""
        self.finish()
        self.current = what
        if self.enabled:
            print(f"[{self.done + 1}/{self.total}] {what} ...{self._left()}", file=self.stream)
            self.stream.flush()

    def finish(self, result: str = "") -> None:
        """The running step is done; ``result``: a line saying what it gave."""
        if self.current is None:
            return
        self.done += 1
        if self.enabled and result:
            print(f"        {self.current}: {result}", file=self.stream)
            self.stream.flush()
        self.current = None
