"""Initialisers: bounds, variance and shape of each distribution against its formula.

Every statistical check uses a tolerance of ``Z`` standard errors of the statistic, computed
from the distribution's own moments (not from the sample), on about a million draws: a wrong
formula (fan_in and fan_out swapped, a missing factor, the wrong family) is many tolerances
away, and with ``Z = 6`` a correct one fails with probability below 1e-8 whatever the seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnlab import init

Z = 6.0  # standard errors allowed
FAN_IN, FAN_OUT = 1200, 800  # unequal, so swapping them is detected
N = FAN_IN * FAN_OUT


def _phi(t: float) -> float:
    return math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _Phi(t: float) -> float:
    return 0.5 * (1.0 + math.erf(t / math.sqrt(2.0)))


def _uniform(a: float):
    """(bound, variance, 4th central moment, cdf) of U(-a, a)."""
    return a, a * a / 3, a**4 / 5, lambda t: min(max((t + a) / (2 * a), 0.0), 1.0)


def _normal(s: float):
    return math.inf, s * s, 3 * s**4, lambda t: _Phi(t / s)


def _trunc(s: float, c: float):
    """N(0, s^2) cut at +-c std: E z^2 = 1 - 2c phi/Zc, E z^4 = 3 E z^2 - 2c^3 phi/Zc."""
    zc = 2 * _Phi(c) - 1
    m2 = 1 - 2 * c * _phi(c) / zc
    m4 = 3 * m2 - 2 * c**3 * _phi(c) / zc
    cdf = lambda t: min(max((_Phi(t / s) - _Phi(-c)) / zc, 0.0), 1.0)  # noqa: E731
    return c * s, m2 * s * s, m4 * s**4, cdf


SCHEMES = {
    "torch": (init.torch_default, _uniform(1 / math.sqrt(FAN_IN))),
    "xavier_uniform": (init.xavier_uniform, _uniform(math.sqrt(6 / (FAN_IN + FAN_OUT)))),
    "xavier_normal": (init.xavier_normal, _normal(math.sqrt(2 / (FAN_IN + FAN_OUT)))),
    "randn": (init.randn, _normal(1.0)),
    "trunc_normal": (init.trunc_normal, _trunc(0.02, 2.0)),
}


def check_distribution(x: np.ndarray, bound: float, var: float, mu4: float, cdf) -> None:
    x = x.astype(np.float64).ravel()
    n = x.size
    # bounds: every draw inside, and the extremes reach the bound on both sides. For
    # delta = 1e-3, P(max x < bound (1 - delta)) = (1 - P(x > bound (1 - delta)))^n with
    # P(...) >= 0.11 delta for these laws (the truncated normal's density at its cut is the
    # lowest): below e^-100 for n ~ 1e6. So a bound too large by 0.1 % is detected.
    if math.isfinite(bound):
        assert np.abs(x).max() <= bound
        assert x.max() > bound * (1 - 1e-3) and x.min() < -bound * (1 - 1e-3)
    # mean 0: standard error sqrt(var / n)
    assert abs(x.mean()) <= Z * math.sqrt(var / n)
    # variance: the sample second moment (mean 0 known) has standard error sqrt((mu4 - var^2)/n)
    se = math.sqrt((mu4 - var * var) / n)
    assert Z * se < 0.02 * var, "test too weak to tell formulas apart"
    assert abs(np.mean(x * x) - var) <= Z * se, (np.mean(x * x), var, Z * se)
    # shape: the empirical CDF at 9 quantiles of the law (binomial standard errors), which
    # tells a uniform from a normal of the same variance
    sd = math.sqrt(var)
    for t in np.linspace(-2.0, 2.0, 9) * sd:
        p = cdf(t)
        emp = np.count_nonzero(x <= t) / n
        assert abs(emp - p) <= Z * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-12, (t, emp, p)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_weight_distribution(name: str) -> None:
    fn, law = SCHEMES[name]
    w = fn(FAN_IN, FAN_OUT, np.random.default_rng(1234), np.float64)
    assert w.shape == (FAN_IN, FAN_OUT) and w.dtype == np.float64
    check_distribution(w, *law)


def test_law_formulas_are_distinct() -> None:
    """The tolerances above are far below the gaps between the schemes' variances."""
    v_torch = 1 / (3 * FAN_IN)
    assert abs(v_torch - 1 / (3 * FAN_OUT)) / v_torch > 0.3  # fan swap
    assert abs(SCHEMES["trunc_normal"][1][1] - 0.02**2) / 0.02**2 > 0.2  # cut ignored
    # the truncated law's std, as documented
    assert math.sqrt(SCHEMES["trunc_normal"][1][1]) == pytest.approx(0.02 * 0.8796, rel=1e-4)


def test_torch_bias_distribution() -> None:
    b = init.torch_default_bias(FAN_IN, N, np.random.default_rng(7), np.float64)
    assert b.shape == (N,)
    check_distribution(b, *_uniform(1 / math.sqrt(FAN_IN)))


@pytest.mark.parametrize("name", ["xavier_uniform", "xavier_normal", "randn", "trunc_normal"])
def test_other_biases_are_zero(name: str) -> None:
    s = init.get(name)
    assert s.bias is init.zeros_bias
    b = s.bias(5, 7, np.random.default_rng(0), np.float32)
    assert b.shape == (7,) and b.dtype == np.float32 and not b.any()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_dtype_seed_and_empty(name: str) -> None:
    fn = init.get(name).weight
    a = fn(6, 5, np.random.default_rng(3), np.float64)
    b = fn(6, 5, np.random.default_rng(3), np.float64)
    c = fn(6, 5, np.random.default_rng(3), np.float32)
    np.testing.assert_array_equal(a, b)
    assert c.dtype == np.float32
    np.testing.assert_array_equal(c, a.astype(np.float32))
    # an integer seed stands for a generator
    np.testing.assert_array_equal(fn(6, 5, 3, np.float64), a)
    assert fn(0, 4, np.random.default_rng(0), np.float64).shape == (0, 4)
    assert fn(4, 0, np.random.default_rng(0), np.float64).shape == (4, 0)


def test_registry() -> None:
    assert init.names() == ["torch", "xavier_uniform", "xavier_normal", "randn", "trunc_normal"]
    assert init.get("torch").weight is init.torch_default
    assert init.get(init.xavier_normal).name == "xavier_normal"
    s = init.get("randn")
    assert init.get(s) is s

    def mine(fan_in, fan_out, _rng, dtype):
        return np.full((fan_in, fan_out), 0.5, dtype)

    custom = init.get(mine)
    assert custom.weight is mine and custom.bias is init.zeros_bias and custom.name == "mine"
    mine.bias = lambda _fi, fo, _rng, dtype: np.ones(fo, dtype)  # type: ignore[attr-defined]
    assert init.get(mine).bias(3, 2, None, np.float64).tolist() == [1.0, 1.0]


def test_errors() -> None:
    with pytest.raises(ValueError, match="init: expected one of"):
        init.get("kaiming")
    with pytest.raises(TypeError, match="init:"):
        init.get(3)
    with pytest.raises(TypeError, match="fan_in: expected an integer, got float"):
        init.torch_default(2.0, 3, None, np.float64)
    with pytest.raises(ValueError, match="fan_out: expected an integer >= 0, got -1"):
        init.xavier_uniform(2, -1, None, np.float64)
    with pytest.raises(TypeError, match=r"rng: expected a numpy.random.Generator"):
        init.randn(2, 2, "seed", np.float64)
    with pytest.raises(TypeError, match="dtype: expected float32 or float64, got int64"):
        init.randn(2, 2, None, np.int64)
