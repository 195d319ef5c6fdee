"""``python -m attnlab bench --accuracy``: what each precision costs, per bench case.

For every case of ``bench --peers`` (the same inputs, made from one seed by
:func:`attnlab._bench.peers_worker.inputs`), the normwise relative error
``||y - y_ref||_F / ||y_ref||_F`` against :mod:`attnlab.reference` in float64 of attnlab in
float32, with ``precision="bf16"``, on float16 inputs and on bfloat16 inputs, beside the same
error of the runtimes a user would pick instead, each in a process of its own
(``peers_worker --no-time``): torch in float32 and under bfloat16 autocast, ONNX Runtime and
OpenVINO at their default precision. The half-precision inputs are the float32 inputs rounded,
weights included: every column is measured against the one float64 result of the float32
inputs, so a column's error includes the rounding of what it stored.

Beside each of attnlab's errors, the bound ``tests/test_half.py`` holds that path to
(:func:`error_bound`, stated in ``docs/guide.md``, "Precision"):

    bound = c (u (1 + rho) + 2**-24 sqrt(K)),  c = 4 (forward), 8 (gradients)

- ``u``: the unit roundoff of the path's operands: 2**-24 (float32), 2**-11 (float16), 2**-8
  (bfloat16 inputs, ``precision="bf16"``). Each operand rounded once is a relative change of at
  most ``u``: the values and the output move by ``u`` relatively.
- ``rho`` (:func:`logit_scale`): ``scale sqrt(d) rms(q) rms(k)``, the size of a typical logit.
  Rounding q and k moves a logit ``s q.k`` by about ``u s sqrt(sum_l q_l**2 k_l**2)``, i.e.
  ``u rho`` (rounding errors are independent and of mean zero: Higham and Mary's probabilistic
  analysis, 2019); a logit moved by ``delta`` moves its softmax weight by a relative
  ``2 delta``.
- ``2**-24 sqrt(K)``: the float32 sums, ``K`` the longest of them (d_model, n_k, d_head).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from typing import Any

import numpy as np

from .. import build_info, get_num_threads, reference
from .common import relative_error
from .peak import worker_env
from .peers import DEFAULT_CASES
from .peers_worker import CASES, Case, inputs
from .progress import Progress

__all__ = [
    "ACCURACY_N",
    "BACKWARD_C",
    "FORWARD_C",
    "PATHS",
    "PEERS",
    "UNIT_ROUNDOFF",
    "attnlab_call",
    "case_scale",
    "error_bound",
    "format_accuracy",
    "logit_scale",
    "markdown_table",
    "run_accuracy",
]

# the unit roundoff u of each storage format: half the distance from 1 to the next number
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
FORWARD_C = 4.0  # the bound's constant for outputs
BACKWARD_C = 8.0  # and for gradients (dS = P * (dP - rowsum(dO * O)) adds a difference)

# attnlab's paths: (key, column label, what it is, the inputs' dtype name, precision=, the
# operands' u)
PATHS: tuple[tuple[str, str, str, str, str | None, float], ...] = (
    ("float32", "fp32", "float32", "float32", None, UNIT_ROUNDOFF["float32"]),
    ("bf16", "bf16", 'precision="bf16"', "float32", "bf16", UNIT_ROUNDOFF["bfloat16"]),
    ("float16", "fp16 in", "float16 inputs", "float16", None, UNIT_ROUNDOFF["float16"]),
    ("bfloat16", "bf16 in", "bfloat16 inputs", "bfloat16", None, UNIT_ROUNDOFF["bfloat16"]),
)

# the peers, each a runtime of peers_worker, and its column label
PEERS: dict[str, str] = {
    "torch-sdpa": "torch fp32",
    "torch-bf16": "torch bf16",
    "onnxruntime": "onnxruntime",
    "openvino-default": "openvino default",
}

# the float64 reference of the long cases at the bench's n = 8192 takes over 20 s and several
# GiB (all heads' score matrices): measured at n = 4096
ACCURACY_N = {"long": 4096, "long-causal": 4096}


def logit_scale(a: Any, b: Any, scale: float | None = None) -> float:
    """``rho = scale * sqrt(d) * rms(a) * rms(b)``: the size of a typical logit of queries ``a``
    and keys ``b`` (``(..., d)``; root mean squares over all their entries); with the default
    scale ``1/sqrt(d)``, ``rms(a) * rms(b)``.

    Rounding every operand by a relative ``u`` moves a logit by about ``u * rho`` (independent
    rounding errors; the worst case is ``sqrt(d)`` times more).

    Parameters
    ----------
    a, b : array_like
        The two factors of the logits (projected query and key heads; for bilinear attention the
        query rows times ``W_i`` and the key rows).
    scale : float, optional
        The logits' scale (default ``1/sqrt(d)``).

    Returns
    -------
    float
    """
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = a64.shape[-1]
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def rms(x: np.ndarray) -> float:
        return float(np.sqrt(np.mean(x * x))) if x.size else 0.0

    return abs(s) * math.sqrt(d) * rms(a64) * rms(b64)


def error_bound(u: float, rho: float, length: int, c: float = FORWARD_C) -> float:
    """The bound on the normwise relative error of an output (or, with ``BACKWARD_C``, of a
    gradient) computed from operands rounded to unit roundoff ``u``, with float32 sums:
    ``c * (u * (1 + rho) + 2**-24 * sqrt(length))``.

    Parameters
    ----------
    u : float
        The operands' unit roundoff (``UNIT_ROUNDOFF``).
    rho : float
        :func:`logit_scale` of the call's queries and keys (0 for a family without a softmax
        over products of two inputs).
    length : int
        The longest float32 sum (the widest projection input, the number of keys, d_head).
    c : float
        ``FORWARD_C`` for outputs, ``BACKWARD_C`` for gradients.

    Returns
    -------
    float
    """
    return c * (u * (1.0 + rho) + UNIT_ROUNDOFF["float32"] * math.sqrt(max(length, 1)))


def _dtype(name: str) -> Any:
    """The NumPy dtype of that name; bfloat16 from ``ml_dtypes`` (ImportError without it)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def attnlab_call(case: Case, arrays: dict[str, np.ndarray], precision: str | None) -> Any:
    """attnlab's call of a case on ``arrays`` (as :func:`peers_worker.inputs` names them):
    ``scaled_dot_product_attention`` for an attention core, else ``multi_head_attention``;
    ``precision`` is passed only when given (a build without the option raises TypeError)."""
    import attnlab

    extra: dict[str, Any] = {} if precision is None else {"precision": precision}
    if case.core_only:
        q, k, v = (arrays[n] for n in ("q", "k", "v"))
        return attnlab.scaled_dot_product_attention(q, k, v, causal=case.causal, **extra)
    w: dict[str, Any] = {n: a for n, a in arrays.items() if n not in ("x", "g")}
    return attnlab.multi_head_attention(
        arrays["x"], num_heads=case.h, causal=case.causal, **w, **extra
    )


def _reference(case: Case, a: dict[str, np.ndarray]) -> np.ndarray:
    if case.core_only:
        return np.asarray(
            reference.scaled_dot_product_attention(a["q"], a["k"], a["v"], causal=case.causal)
        )
    w: dict[str, Any] = {n: v for n, v in a.items() if n not in ("x", "g")}
    out = reference.multi_head_attention(a["x"], num_heads=case.h, causal=case.causal, **w)
    return np.asarray(out)


def case_scale(case: Case, a: dict[str, np.ndarray]) -> tuple[float, int]:
    """The case's ``rho`` (:func:`logit_scale` of its projected query and key heads, or of its
    q and k) and its longest float32 sum."""
    dh = case.d // case.h
    if case.core_only:
        return logit_scale(a["q"], a["k"]), max(case.n, dh)
    x = a["x"].astype(np.float64)
    q = (x @ a["w_q"] + a["b_q"]).reshape(-1, case.h, dh)
    k = (x @ a["w_k"] + a["b_k"]).reshape(-1, case.h, dh)
    return logit_scale(q, k), max(case.d, case.n, dh)


def _path(
    case: Case, a: dict[str, np.ndarray], dtype_name: str, precision: str | None
) -> tuple[np.ndarray | None, str]:
    """attnlab's output on the case's inputs stored as ``dtype_name``, or (None, why not)."""
    try:
        dtype = _dtype(dtype_name)
    except ImportError:
        return None, "ml_dtypes is not installed (it names bfloat16 for NumPy)"
    cast = {n: v.astype(dtype) for n, v in a.items()}
    try:
        out = np.asarray(attnlab_call(case, cast, precision))
    except (TypeError, ValueError) as e:
        return None, f"refused by this build: {type(e).__name__}: {e}"[:200]
    if out.dtype != np.dtype(dtype):
        return None, f"returned {out.dtype} for {dtype_name} inputs: not computed natively here"
    return out, ""


def _peer(
    runtime: str, name: str, case: Case, threads: int, tmp: str
) -> tuple[np.ndarray | None, str, str]:
    """A peer's output on the case (its own process), or None and why; and its version."""
    out = os.path.join(tmp, f"{runtime}-{name}.npy")
    cmd = [sys.executable, "-m", "attnlab._bench.peers_worker", runtime, name, "--no-time"]
    cmd += ["--n", str(case.n), "--threads", str(threads), "--out", out]
    try:
        res = subprocess.run(
            cmd,
            check=False,
            capture_output=True,
            text=True,
            env=worker_env(threads),
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        return None, "timed out (30 min)", ""
    lines = res.stdout.strip().splitlines()
    try:
        head = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:  # a worker that died mid-line: reported with its stderr
        head = {}
    if "skip" in head:
        return None, f"skipped: {head['skip']}", ""
    if "error" in head or not os.path.exists(out):
        why = head.get("error") or " | ".join(res.stderr.strip().splitlines()[-2:])
        return None, f"failed: {why}"[:300], ""
    return np.load(out), "", str(head.get("version", ""))


def run_accuracy(
    quick: bool,
    cases: tuple[str, ...] | None = None,
    runtimes: tuple[str, ...] = tuple(PEERS),
    show_progress: bool = False,
) -> dict[str, Any]:
    """Measures the accuracy table.

    Parameters
    ----------
    quick : bool
        Without ``cases``: the cases of ``bench --peers --quick`` (no long ones).
    cases : tuple of str, optional
        Names from ``peers_worker.CASES`` (default: those of ``bench --peers``).
    runtimes : tuple of str
        Peers from ``PEERS``.
    show_progress : bool
        Print each step on stderr.

    Returns
    -------
    dict
        date, cpu, threads, isa, bf16_kernel, ``rows`` (one dict per case: label, shape,
        ``n_note``, rho, length, ``errors`` and ``bounds`` by path key, ``peers`` by runtime),
        ``versions`` by runtime and ``notes``.
    """
    from .runner import _cpu_name

    for c in cases or ():
        if c not in CASES:
            raise ValueError(f"cases: unknown case {c!r}; expected one of {', '.join(CASES)}")
    for r in runtimes:
        if r not in PEERS:
            raise ValueError(f"runtimes: unknown runtime {r!r}; expected one of {', '.join(PEERS)}")
    if cases is None:
        cases = tuple(c for c in DEFAULT_CASES if not (quick and CASES[c].long))
    threads = get_num_threads()
    progress = Progress(len(cases) * (2 + len(runtimes)), show_progress)
    rows: list[dict[str, Any]] = []
    notes: dict[str, list[str]] = {}  # why -> the cases it applies to
    versions: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="attnlab-accuracy-") as tmp:
        for name in cases:
            case = CASES[name]
            if name in ACCURACY_N:
                case = replace(case, n=ACCURACY_N[name])
            a = inputs(case)
            progress.step(f"{case.label}: float64 reference")
            t0 = time.perf_counter()
            ref = _reference(case, a)
            ref_s = time.perf_counter() - t0
            progress.finish(f"{ref_s:.1f} s")
            rho, length = case_scale(case, a)
            row: dict[str, Any] = {
                "case": name,
                "label": case.label,
                "shape": case.shape,
                "n_note": (
                    f"n={case.n}, not the bench's {CASES[name].n}: the float64 reference there "
                    "takes over 20 s"
                    if case.n != CASES[name].n
                    else ""
                ),
                "reference_s": round(ref_s, 2),
                "rho": rho,
                "length": length,
                "errors": {},
                "bounds": {},
                "peers": {},
            }
            progress.step(f"{case.label}: attnlab")
            for key, _, what, dtype_name, precision, u in PATHS:
                row["bounds"][key] = error_bound(u, rho, length)
                out, why = _path(case, a, dtype_name, precision)
                row["errors"][key] = None if out is None else relative_error(out, ref)
                if why:
                    notes.setdefault(f"attnlab {what}: {why}", []).append(case.label)
            for rt in runtimes:
                progress.step(f"{case.label}: {rt}")
                got, why, version = _peer(rt, name, case, threads, tmp)
                row["peers"][rt] = None if got is None else relative_error(got, ref)
                if version:
                    versions[rt] = version
                if why:
                    notes.setdefault(f"{PEERS[rt]}: {why}", []).append(case.label)
            rows.append(row)
    progress.finish()
    info = build_info()
    return {
        "date": datetime.date.today().isoformat(),
        "quick": quick,
        "cpu": _cpu_name(),
        "threads": threads,
        "isa": info.get("isa"),
        "bf16_kernel": info.get("bf16_kernel"),
        "version": info.get("version"),
        "rows": rows,
        "versions": versions,
        "notes": [f"{why} ({', '.join(labels)})" for why, labels in notes.items()],
    }


def _e(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def _shape(row: dict[str, Any]) -> str:
    return row["shape"] + (" *" if row["n_note"] else "")


_LEGEND = (
    "error: ||y - y_ref||_F / ||y_ref||_F against attnlab.reference in float64 on the case's "
    'float32 inputs. attnlab in float32 (fp32), with precision="bf16" (bf16: bf16 products, '
    "float32 sums), on float16 and on bfloat16 inputs (fp16 in, bf16 in: every input and weight "
    "rounded to it, so the error includes that rounding). bound: what tests/test_half.py "
    "holds the path to, "
    "{c:g} (u (1 + rho) + 2^-24 sqrt(K)): u the operands' unit roundoff (float32 2^-24, "
    'float16 2^-11, bfloat16 and precision="bf16" 2^-8), rho = scale sqrt(d_head) rms(q) '
    "rms(k) the size of a typical logit, K the longest sum (docs/guide.md, Precision). "
    "Peers in their own processes: torch fp32 (F.linear + SDPA), torch bf16 (the same under "
    "torch.autocast bfloat16), ONNX Runtime and OpenVINO at their default precision. "
    "-: not measured (see the notes)."
)


def format_accuracy(result: dict[str, Any]) -> str:
    """The accuracy table in the style of ``bench``'s report: a header, one table (per case
    attnlab's error and bound on each path, then each peer's error), the legend and the notes.

    Parameters
    ----------
    result : dict
        What :func:`run_accuracy` returns.

    Returns
    -------
    str
    """
    from .report import WIDTH
    from .runner import table

    quick = " --quick" if result.get("quick") else ""
    lines = [
        (
            f"attnlab {result.get('version') or ''} bench --accuracy{quick}, {result['date']}: "
            "normwise relative error against the float64 reference"
        ),
        (
            f"CPU: {result['cpu']}; instruction set in use: {result['isa']}; bf16 kernel: "
            f"{result.get('bf16_kernel')}; {result['threads']} threads"
        ),
        "",
    ]
    rows: list[dict[str, Any]] = result["rows"]
    peers = [rt for rt in PEERS if any(rt in r["peers"] for r in rows)]
    head = ["case", "shape", "rho"]
    for _key, label, *_ in PATHS:
        head += [label, "bound"]
    head += [PEERS[rt] for rt in peers]
    body = []
    for r in rows:
        cells = [r["label"], _shape(r), f"{r['rho']:.2f}"]
        for key, *_ in PATHS:
            cells += [_e(r["errors"].get(key)), _e(r["bounds"].get(key))]
        cells += [_e(r["peers"].get(rt)) for rt in peers]
        body.append(cells)
    lines += table(head, body, 2)
    over = [
        f"{r['label']} {label}"
        for r in rows
        for key, _, label, *_ in PATHS
        if r["errors"].get(key) is not None and not r["errors"][key] <= r["bounds"][key]
    ]
    lines.append("")
    if over:
        lines.append(f"ABOVE ITS BOUND: {', '.join(over)}")
    lines += textwrap.wrap(_LEGEND.format(c=FORWARD_C), WIDTH)
    starred = [r for r in rows if r["n_note"]]
    if starred:
        lines += textwrap.wrap(
            "*: " + "; ".join(f"{r['label']}: {r['n_note']}" for r in starred), WIDTH
        )
    if result.get("versions"):
        lines += textwrap.wrap(
            "Versions: " + "; ".join(f"{PEERS[k]}: {v}" for k, v in result["versions"].items()),
            WIDTH,
        )
    if result.get("notes"):
        lines += ["", "Notes:"] + [f"  {n}" for n in result["notes"]]
    return "\n".join(lines)


def markdown_table(result: dict[str, Any], cases: tuple[str, ...] | None = None) -> str:
    """The table as Markdown, errors only (the README's short version): one line per case,
    attnlab's paths then the peers."""
    rows = [r for r in result["rows"] if cases is None or r["case"] in cases]
    peers = [rt for rt in PEERS if any(rt in r["peers"] for r in rows)]
    head = ["case"] + [label for _k, label, *_ in PATHS] + [PEERS[rt] for rt in peers]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"] + (" *" if r["n_note"] else "")]
        cells += [_e(r["errors"].get(k)) for k, *_ in PATHS]
        cells += [_e(r["peers"].get(rt)) for rt in peers]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
