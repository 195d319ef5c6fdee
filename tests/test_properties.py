"""Property-based tests (hypothesis) of every public function against ``attnlab.reference``.

Random valid calls (shapes, batch broadcasting, dtypes, bool/float/-inf masks, key padding,
causal modes, grouped-query heads, biases, scales, returned weights) must agree with the float64
oracle: normwise relative error ``max |got - ref| / (|ref| + max|ref|)`` at most 1e-12 in float64
and 1e-5 in float32 (the documented tolerance). Gradients are checked along random directions
against central differences of the float64 *reference* (so the oracle checks the backward too),
and float32 gradients against the float64 kernel's.

Random broken calls must raise ``ValueError``/``TypeError`` naming the argument; odd memory
layouts (Fortran order, strided, reversed, read-only, zero-strided, misaligned, nested lists)
must give the result of contiguous copies and leave the inputs untouched. The case builders and
mutations live in ``fuzz_stress.py`` (also the 10,000-call stress script of ``test_fuzz.py``).

Examples are derandomised (the same every run) and sized so the file runs in well under a
minute on two cores.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab
import fuzz_stress as F
from attnlab import reference as R
from attnlab.reference._mha import allowed_and_bias
from conftest import _MAX_ERR

# the random boolean masks drawn here leave whole rows empty at times, on purpose
pytestmark = pytest.mark.empty_rows

FORWARD = list(F.FORWARD_BUILDERS)
ALL = F.FAMILIES

_base = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FAST = settings(max_examples=60, **_base)
SLOW = settings(max_examples=25, **_base)


def _note(key: str, err: float) -> None:
    """Record the largest error per label: printed in the session summary (conftest)."""
    label = "prop " + key
    _MAX_ERR[(label, "")] = max(_MAX_ERR[(label, "")], err)


def _dtype(data: st.DataObject) -> np.dtype:
    return np.dtype(data.draw(st.sampled_from(F.DTYPES), label="dtype"))


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("family", FORWARD)
@FAST
@given(data=st.data())
def test_forward_matches_reference(family: str, data: st.DataObject) -> None:
    dtype = _dtype(data)
    case = F.build(F.HypothesisChooser(data), family, dtype)
    err = F.oracle_error(case, case.call(), np.random.default_rng(0))
    _note(f"{family} {dtype.name}", err)


@pytest.mark.parametrize("family", F.BF16_FAMILIES)
@SLOW
@given(data=st.data())
def test_bf16_forward_matches_the_rounded_reference(family: str, data: st.DataObject) -> None:
    """precision="bf16" on float32 cases: within the fuzzer's bound of the reference with the
    same operands rounded (``F.check_bf16``)."""
    case = F.build(F.HypothesisChooser(data), family, np.dtype(np.float32))
    _note(f"{family} bf16", F.check_bf16(case))


@pytest.mark.parametrize("dtype", F.DTYPES)
@FAST
@given(data=st.data())
def test_collapse_qk_matches_reference(dtype: type, data: st.DataObject) -> None:
    case = F.build(F.HypothesisChooser(data), "collapse_qk", dtype)
    err = F.oracle_error(case, case.call(), np.random.default_rng(0))
    _note(f"collapse_qk {np.dtype(dtype).name}", err)


@pytest.mark.parametrize("dtype", F.DTYPES)
@FAST
@given(data=st.data())
def test_factorize_qk_matches_reference(dtype: type, data: st.DataObject) -> None:
    """Factors are unique only up to signs: the oracle compares the products and the errors."""
    case = F.build(F.HypothesisChooser(data), "factorize_qk", dtype)
    err = F.oracle_error(case, case.call(), np.random.default_rng(0))
    _note(f"factorize_qk {np.dtype(dtype).name}", err)


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("family", FORWARD)
@SLOW
@given(data=st.data())
def test_backward_matches_finite_differences(family: str, data: st.DataObject) -> None:
    """float64 gradients against central differences of the reference (step 1e-6) along one
    random direction per argument: agreement to 1e-6 of |grad| |D|."""
    c = F.HypothesisChooser(data)
    case = F.build(c, family + "_backward", np.float64)
    grads = case.call()
    expected = {
        n for n in case.arrays if n != "grad_out" and isinstance(case.kwargs.get(n), np.ndarray)
    }
    if family == "bilinear_attention" and isinstance(case.kwargs["w_qk"], attnlab.BilinearQK):
        expected.add("w_qk")
        if case.kwargs["w_qk"].u is not None:
            expected.add("u_k")
    mask = case.kwargs.get("mask")
    if isinstance(mask, np.ndarray) and mask.dtype != np.bool_:  # an additive bias
        expected.add("mask")
    if case.kwargs.get("sinks") is not None:  # their gradient (checked in test_options.py)
        expected.add("sinks")
    assert set(grads) == expected
    for name, g in grads.items():
        if isinstance(case.kwargs.get(name), np.ndarray):
            assert g.shape == case.kwargs[name].shape, name
            assert g.dtype == np.float64
    with np.errstate(all="ignore"):
        err = F.directional_error(case, grads, np.random.default_rng(c.seed()))
    _note(f"{family}_backward vs finite differences", err)
    assert err <= 1e-6


@pytest.mark.parametrize("family", FORWARD)
@SLOW
@given(data=st.data())
def test_backward_float32_matches_float64(family: str, data: st.DataObject) -> None:
    """float32 gradients against the float64 kernel's on the same (float32) values:
    normwise relative error below 1e-4, measured against the largest gradient entry of the
    call (gradients that are mathematically 0, as the query's with a single key, come out as
    rounding noise)."""
    case = F.build(F.HypothesisChooser(data), family + "_backward", np.float32)
    got = case.call()
    kw64 = {
        k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype == np.float32 else v)
        for k, v in case.kwargs.items()
    }
    if isinstance(kw64.get("w_qk"), attnlab.BilinearQK):
        qk = kw64["w_qk"]
        kw64["w_qk"] = attnlab.BilinearQK(
            *(None if a is None else a.astype(np.float64) for a in (qk.w, qk.u, qk.v, qk.c)),
            d_head=qk.d_head,
        )
    want = case.fn(**kw64)
    assert sorted(got) == sorted(want)
    floor = F.grad_scale(want)
    for k in got:
        _note(f"{family}_backward float32", F.compare(got[k], want[k], np.float32, 1e-4, floor))


# ----------------------------------------------------------------------------- invalid calls


@pytest.mark.parametrize("family", ALL)
@FAST
@given(data=st.data())
def test_invalid_call_raises_named_error(family: str, data: st.DataObject) -> None:
    c = F.HypothesisChooser(data)
    case = F.build(c, family, _dtype(data))
    bad = F.invalid_variant(c, case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(bad.errors) as info:
            case.fn(**bad.kwargs)
    assert re.search(bad.names, str(info.value)), (bad.label, str(info.value))


@pytest.mark.parametrize("family", ALL)
@FAST
@given(data=st.data())
def test_odd_layouts_give_the_same_result(family: str, data: st.DataObject) -> None:
    c = F.HypothesisChooser(data)
    dtype = _dtype(data)
    case = F.build(c, family, dtype)
    odd, plain = F.layout_variant(c, case)
    before = F.snapshot(odd)
    got = case.fn(**odd)
    want = case.fn(**plain)
    F.results_equal(got, want, dtype)
    assert F.unchanged(before, odd), "an input array was modified"


@pytest.mark.parametrize("family", ALL)
@FAST
@given(data=st.data())
def test_nan_inf_never_crash(family: str, data: st.DataObject) -> None:
    """NaN/Inf in any array: a result of the right shape and dtype (NaN/Inf propagate), or,
    for factorize_qk only, a ValueError naming ``w`` (the SVD is undefined)."""
    c = F.HypothesisChooser(data)
    dtype = _dtype(data)
    case = F.build(c, family, dtype)
    kw = F.nonfinite_variant(c, case)
    with np.errstate(all="ignore"):
        if family == "factorize_qk":
            with pytest.raises(ValueError, match="w"):
                case.fn(**kw)
            return
        got = case.fn(**kw)
        clean = case.fn(**case.kwargs)
    if isinstance(got, dict):
        assert sorted(got) == sorted(clean)
        for k in got:
            assert got[k].shape == clean[k].shape and got[k].dtype == clean[k].dtype
    elif isinstance(got, tuple):
        assert [g.shape for g in got] == [g.shape for g in clean]
    elif isinstance(got, np.ndarray):
        assert got.shape == clean.shape and got.dtype == clean.dtype


@pytest.mark.parametrize("path", ["flash", "weights"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", F.DTYPES)
@FAST
@given(data=st.data())
def test_sdpa_nan_propagates_to_exactly_the_rows_it_reaches(
    path: str, where: str, dtype: type, data: st.DataObject
) -> None:
    """A NaN in q[i] makes row i NaN; a NaN in k[j] every row that may attend key j; a NaN in
    v[j, c] column c of those rows; and nothing else: a masked-out key is never read, so a row
    that may not attend key j never sees its NaN, whatever the tile sizes and on both the flash
    and the weights path (it used to depend on both). Every other entry equals the reference
    computed with the NaN replaced by 0. Fully masked rows stay 0."""
    c = F.HypothesisChooser(data)
    case = F.build(c, "scaled_dot_product_attention", dtype)
    kw = dict(case.kwargs, return_weights=path == "weights", return_lse=False)
    if kw["mask"] is not None and kw["mask"].dtype != bool:
        kw["mask"] = None
    a = kw[where].copy()
    a[tuple(c.int(0, s - 1) for s in a.shape)] = np.nan
    kw[where] = a
    with np.errstate(all="ignore"):
        got = case.fn(**kw)
        got = got[0] if path == "weights" else got
        clean = R.scaled_dot_product_attention(
            **{**kw, where: np.nan_to_num(a, nan=0.0), "return_weights": False}
        )
        want = R.scaled_dot_product_attention(**{**kw, "return_weights": False})
    q, k, v = kw["q"], kw["k"], kw["v"]
    h, n_q, n_k = q.shape[-3], q.shape[-2], k.shape[-2]
    group = h // k.shape[-3]
    allowed, _ = allowed_and_bias(n_q, n_k, kw["mask"], None, kw["causal"], kw.get("window"))
    A = np.broadcast_to(allowed, got.shape[:-1] + (n_k,)).astype(np.float64)
    if where == "q":
        must = np.isnan(q).any(-1) & (A.sum(-1) > 0)  # (..., h, n_q)
        must = np.broadcast_to(must[..., None], got.shape)
    elif where == "k":
        kn = np.repeat(np.isnan(k).any(-1), group, axis=-2)  # (..., h, n_k)
        must = (A @ kn[..., None].astype(np.float64))[..., 0] > 0  # (..., h, n_q)
        must = np.broadcast_to(must[..., None], got.shape)
    else:
        vn = np.repeat(np.isnan(v), group, axis=-3).astype(np.float64)  # (..., h, n_k, d_v)
        must = (A @ vn) > 0
    must = np.broadcast_to(must, got.shape)
    nan = np.isnan(got)
    assert nan[must].all(), "a NaN did not reach an output it feeds"
    assert not nan[~must].any(), f"a NaN in {where} reached an output that cannot see it"
    assert np.array_equal(np.isnan(want), nan), "the reference follows another rule"
    ok = ~must
    tol = 1e-4 if np.dtype(dtype) == np.float32 else 1e-10
    scale = max(float(np.max(np.abs(clean))), 1e-300) if clean.size else 1.0
    assert np.all(np.abs(got[ok] - clean[ok]) <= tol * (np.abs(clean[ok]) + scale))


# ----------------------------------------------------------------------------- empty


@pytest.mark.parametrize("family", FORWARD)
@pytest.mark.parametrize("axis", ["batch", "tokens"])
def test_empty_dimensions(family: str, axis: str) -> None:
    """A zero-length batch or token axis gives an empty result of the right shape."""
    c = F.Chooser(np.random.default_rng(3))
    case = F.build(c, family, np.float64)
    kw = dict(case.kwargs)
    names = {
        "scaled_dot_product_attention": ["q", "k", "v"],
        "multi_head_attention": ["query", "key", "value"],
        "bilinear_attention": ["query", "key", "value"],
    }.get(family, ["x"])
    for k in ("mask", "key_padding_mask"):
        kw.pop(k, None)
    for name in names:
        if name not in kw:
            continue
        a = kw[name]
        if axis == "batch":
            a = a.reshape((1,) * (a.ndim < 4) + a.shape)  # at least one batch axis
            kw[name] = a[:0]
        elif name in ("q", "query", "x"):
            kw[name] = a[..., :0, :]
    full = case.call()
    full = full[0] if isinstance(full, tuple) else full
    got = case.fn(**kw)
    got = got[0] if isinstance(got, tuple) else got
    assert got.dtype == np.float64 and got.size == 0
    assert got.ndim in (full.ndim, full.ndim + 1)  # + 1: a batch axis was added
    assert got.shape[-1] == full.shape[-1]
