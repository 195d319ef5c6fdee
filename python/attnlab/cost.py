"""Parameter / FLOP / memory cost model for separate vs collapsed Q-K. Placeholder (issue 3)."""

from __future__ import annotations

from typing import Any

__all__ = ["attention_cost", "plan_qk"]


def attention_cost(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def plan_qk(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
