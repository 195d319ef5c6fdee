"""Command line: ``python -m attnlab bench [--quick] [--verbose] [--targets] [--json PATH]
[--plot PATH]``,
``python -m attnlab bench --peers [--train] [--case NAME] [--runtime NAME]``,
``python -m attnlab bench --accuracy [--quick] [--case NAME] [--runtime NAME]``,
``python -m attnlab bench --half [--quick] [--case NAME] [--bf16]`` and
``python -m attnlab info``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from . import build_info
from ._bench.half import CASES as HALF_CASES
from ._bench.peers import DEFAULT_CASES
from ._bench.peers_worker import CASES


def _table(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    run: Callable[[bool], dict[str, Any]],
    fmt: Callable[[dict[str, Any]], str],
) -> int:
    """A mode that prints one table (--accuracy, --half): run(show_progress), its table, its JSON
    when asked; a ValueError of the run (an unknown case or runtime) is a command-line error."""
    try:
        result = run(sys.stdout.isatty() if args.progress is None else args.progress)
    except ValueError as e:
        parser.error(str(e))
    print(fmt(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlab")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time every family against the reference and PyTorch")
    b.add_argument("--quick", action="store_true", help="small sizes, finishes in about a minute")
    b.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    b.add_argument(
        "--plot",
        metavar="PATH",
        help="also plot time against n (PNG): log-log, one panel per family, with the slopes",
    )
    b.add_argument(
        "--verbose",
        action="store_true",
        help="also print every row: each implementation, the timing noise, the GEMM rows, the "
        "FMA peak's check and the project's performance targets",
    )
    b.add_argument(
        "--targets",
        action="store_true",
        help="also print the project's performance targets, checked on this run",
    )
    b.add_argument(
        "--only",
        metavar="FAMILY",
        action="append",
        help="run only this family (gemm, mha, bilinear, additive, backward); repeatable",
    )
    b.add_argument(
        "--peers",
        action="store_true",
        help="attnlab against torch, ONNX Runtime, OpenVINO and JAX, each in its own "
        "process (install them with the 'bench' extra; missing ones are skipped)",
    )
    b.add_argument(
        "--accuracy",
        action="store_true",
        help="the normwise error against the float64 reference of attnlab in float32, with "
        "precision='bf16' and on float16 and bfloat16 inputs, beside torch (float32, bfloat16 "
        "autocast), ONNX Runtime and OpenVINO (default precision) on the same inputs, on the "
        "cases of --peers (runtimes: torch-sdpa, torch-bf16, onnxruntime, openvino-default)",
    )
    b.add_argument(
        "--half",
        action="store_true",
        help="float16 inputs against the same values in float32, call by call in one process "
        "(SDPA forward, weights and backward, decoding, MHA, the pooled families, bilinear and "
        "latent attention): issue 31's target, float16 never slower",
    )
    # the cases as the bench defines them (one list, one place)
    inference = [c for c, case in CASES.items() if not case.train]
    train = [c for c, case in CASES.items() if case.train]
    b.add_argument(
        "--case",
        metavar="NAME",
        action="append",
        help=f"with --peers or --accuracy: run only this case ({', '.join(inference)}; training "
        f"steps: {', '.join(train)}); repeatable. Default: the inference cases but "
        f"{' and '.join(c for c in inference if c not in DEFAULT_CASES)} (--quick: no long ones). "
        f"With --half: one of its cases ({', '.join(HALF_CASES)})",
    )
    b.add_argument(
        "--bf16",
        action="store_true",
        help="with --peers: bf16 products against the peers' (cases vit-b, sdpa, decode, "
        "decode-gqa; runtimes attnlab (float32: the check), attnlab-bf16 (precision='bf16'; "
        "a bfloat16 cache when decoding), attnlab-bf16-packed (the same with PackedWeight "
        "weights), torch-bf16, openvino-default); with --half: "
        "precision='bf16' on both calls of every case that takes it",
    )
    b.add_argument(
        "--train",
        action="store_true",
        help="with --peers: the training-step cases (vit-s-train, long-causal-train; "
        "--quick: vit-s-train only) instead of the inference ones: forward + every "
        "gradient in attnlab (vjp + pullback; also the forward and the pullback alone), "
        "torch autograd and JAX; not in the default run (1.5 minutes on a quiet 2-core machine)",
    )
    b.add_argument(
        "--runtime",
        metavar="NAME",
        action="append",
        help="with --peers: only this runtime (attnlab, torch-sdpa, torch-mha, "
        "onnxruntime, openvino, jax); with --accuracy: torch-sdpa, torch-bf16, onnxruntime, "
        "openvino-default; repeatable",
    )
    b.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print each step, the rows as they finish and the time left on stderr "
        "(default: when stdout is a terminal)",
    )
    sub.add_parser("info", help="print build_info()")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(json.dumps(build_info(), indent=2))
        return 0
    cases = tuple(args.case) if args.case else None
    if args.half:
        if (
            args.peers
            or args.accuracy
            or args.only
            or args.plot
            or args.verbose
            or args.targets
            or args.runtime
            or args.train
        ):
            parser.error("--half takes --quick, --case, --bf16, --json and --progress only")
        from ._bench.half import format_half, run_half

        precision = "bf16" if args.bf16 else None
        return _table(
            parser, args, lambda show: run_half(args.quick, cases, show, precision), format_half
        )
    if (args.case or args.runtime) and not (args.peers or args.accuracy):
        parser.error("--case and --runtime go with --peers, --accuracy or --half")
    if args.train and not args.peers:
        parser.error("--train goes with --peers")
    if args.bf16 and (not args.peers or args.train):
        parser.error("--bf16 goes with --peers (inference cases) or --half")
    if args.accuracy:
        if args.peers or args.only or args.plot or args.verbose or args.targets or args.train:
            parser.error("--accuracy takes --quick, --case, --runtime, --json and --progress only")
        from ._bench.accuracy import PEERS, format_accuracy, run_accuracy

        runtimes = tuple(args.runtime) if args.runtime else tuple(PEERS)
        return _table(
            parser,
            args,
            lambda show: run_accuracy(args.quick, cases, runtimes, show_progress=show),
            format_accuracy,
        )
    if args.train and args.case:
        parser.error("--train chooses the training cases: name them with --case alone")
    show_progress = sys.stdout.isatty() if args.progress is None else args.progress
    if args.peers:
        if args.only or args.plot or args.verbose or args.targets:
            parser.error(
                "--only, --plot, --verbose and --targets do not go with --peers (its table "
                "shows every row and target)"
            )
        from ._bench.peers import format_peers, run_peers
        from ._bench.peers_worker import RUNTIMES
        from ._bench.runner import to_json as peers_json

        try:
            peers = run_peers(
                args.quick,
                cases,
                tuple(args.runtime) if args.runtime else RUNTIMES,
                train=args.train,
                show_progress=show_progress,
                bf16=args.bf16,
            )
        except ValueError as e:
            parser.error(str(e))
        print(format_peers(peers))
        if args.json:
            with open(args.json, "w") as f:
                f.write(peers_json(peers))
        return 0
    from ._bench.report import format_report
    from ._bench.runner import FAMILIES, plot, run_all, to_json

    fams = tuple(args.only) if args.only else FAMILIES
    result = run_all(args.quick, fams, show_progress)
    print(format_report(result, verbose=args.verbose, targets=args.targets))
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(result))
    if args.plot and not plot(result, args.plot):
        print(
            f"--plot: {args.plot} not written: no family of this run was timed at two n or more",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
