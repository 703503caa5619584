"""The ``lossscale`` command: ``demo``, ``audit-demo``, ``formats`` and ``report``.

Everything heavy (scikit-learn, matplotlib, tqdm, the demo itself) is imported inside the
subcommand that needs it, so ``import lossscale`` and ``lossscale --help`` stay light.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

__all__ = ["main", "build_parser"]

_SIGPIPE_STATUS = 128 + 13  # what a shell reports for a program ended by SIGPIPE

_DEMO_EXTRA_HINT = (
    "`lossscale {cmd}` needs the demo extras ({missing}). Install them with:\n    pip install {missing_args}\n"
    "or, in a lossscale checkout, with the versions the project tests:\n    pip install -c constraints.txt -e '.[demo]'"
)

_DESCRIPTION = """\
lossscale: safe, observable FP16 loss scaling for PyTorch.

  lossscale demo              train a small MLP on sklearn's digits in FP32 and FP16 and measure,
                              claim by claim, why FP16 training stalls without loss scaling and how
                              static and dynamic scaling fix it; writes an HTML report.
  lossscale audit-demo        a GPT-2-shaped model whose MLP overflows FP16 in the forward: lossscale.audit
                              names the module, keep_fp32 makes it train; then a model whose backward
                              overflows FP16 at any scale >= 1, beside FP32; writes an HTML report.
  lossscale formats           the range facts of fp16, bf16, fp32 and fp8, and FP16's underflow cliff.
  lossscale report RUN.jsonl  the same plots for your own run, from lossscale's JSONL telemetry.
"""

_DEMO_EPILOG = """\
examples:
  lossscale demo                      # 1-2 minutes on 2 CPU cores; report in lossscale-report/
  lossscale demo --quick              # 15-30 s: fewer epochs, a coarser sweep
  python -m lossscale demo --out /tmp/r --seed 1

The report (index.html + PNGs) and summary.json hold every measured figure. Each claim gets a
verdict computed from its measurements: HELD when every check passes, NOT HELD when one fails.
"""

_REPORT_EPILOG = """\
RUN.jsonl holds one JSON object per line: {"step": 0, "loss_scale": 65536.0, "skipped": false,
"grad/flushed_frac": 0.01, "grad/headroom_bits": 7.5, ...}; per-layer keys such as
"act/fc1/flushed_frac" are plotted too. The full schema: python -c "import lossscale.report.schema as s; help(s)"
"""


def _missing_demo_deps(need_sklearn: bool = True) -> List[str]:
    import importlib.util

    names = (["sklearn"] if need_sklearn else []) + ["matplotlib"]
    return [{"sklearn": "scikit-learn"}.get(n, n) for n in names if importlib.util.find_spec(n) is None]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(
        prog="lossscale", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    try:
        from importlib.metadata import version

        ver = version("lossscale")
    except Exception:  # not installed (running from a source tree)
        ver = "unknown"
    parser.add_argument("--version", action="version", version=f"lossscale {ver}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,audit-demo,formats,report}")

    demo = sub.add_parser(
        "demo",
        help="measure every claim of FP16 loss scaling on real data; write a report",
        description="Train a small MLP on sklearn's digits in FP32 and FP16 (no scaling, static,\n"
        "dynamic, adaptive, torch's default, two clip orders, a sweep of static scales) and\n"
        "check each claim of loss scaling against what the runs measured.",
        epilog=_DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--quick", action="store_true", help="CI size: fewer epochs and a coarser sweep (15-30 s on 2 cores)"
    )
    demo.add_argument(
        "--out",
        metavar="DIR",
        default="lossscale-report",
        help="where to write index.html, the PNGs and summary.json (default: %(default)s)",
    )
    demo.add_argument("--seed", type=int, default=0, help="data split, initialisation and batch order (default: 0)")
    demo.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they are off anyway when stderr is not a terminal)",
    )

    aud = sub.add_parser(
        "audit-demo",
        help="find a forward overflow with lossscale.audit, fix it with keep_fp32",
        description="Build a GPT-2-shaped model whose first MLP down-projection overflows FP16 in\n"
        "the forward, audit one batch, and train it in FP32, in FP16 and in FP16 with the named\n"
        "module kept in FP32. Then train a small model whose backward overflows FP16 at any\n"
        "scale >= 1 with torch's GradScaler, lossscale's with min_scale=1.0, its default and\n"
        "on_backward_overflow='upcast', beside FP32: the steps taken and the loss curves\n"
        "(15-30 s on 2 cores; --quick: about half).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    aud.add_argument("--quick", action="store_true", help="30 training steps instead of 80")
    aud.add_argument(
        "--out",
        metavar="DIR",
        default="lossscale-audit-report",
        help="where to write index.html, the PNGs and summary.json (default: %(default)s)",
    )
    aud.add_argument("--seed", type=int, default=0, help="initialisation and batches (default: 0)")

    fmts = sub.add_parser(
        "formats",
        help="the range facts of fp16, bf16, fp32, fp8 e4m3/e5m2, and the cliff",
        description="Print every format's largest value, smallest normal and subnormal, and the\n"
        "thresholds where values flush to 0 or overflow, all derived from the bit layouts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fmts.add_argument(
        "--cliff", metavar="FMT", default="fp16", help="the format whose cliff to spell out (default: %(default)s)"
    )

    rep = sub.add_parser(
        "report",
        help="plot your own run from lossscale's JSONL telemetry",
        description="Draw the scale, skipped steps, flushed fraction and headroom of a run\n"
        "recorded as JSONL, and write DIR/index.html, the PNGs and DIR/summary.json.",
        epilog=_REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("jsonl", metavar="RUN.jsonl", help="the telemetry file")
    rep.add_argument(
        "--out", metavar="DIR", default="lossscale-run-report", help="output directory (default: %(default)s)"
    )
    return parser


def _cmd_demo(args) -> int:
    missing = _missing_demo_deps()
    if missing:
        print(
            _DEMO_EXTRA_HINT.format(cmd="demo", missing=", ".join(missing), missing_args=" ".join(missing)),
            file=sys.stderr,
        )
        return 2
    from .report.html import check_out_dir

    try:
        check_out_dir(args.out)  # before a minute of training, not after it
    except ValueError as e:
        print(f"lossscale demo: --out {e}", file=sys.stderr)
        return 2
    from .demo.run import run_demo

    t0 = time.perf_counter()
    summary = run_demo(args.out, quick=args.quick, seed=args.seed, progress=not args.no_progress)
    verdicts = summary["verdicts"]
    failed = [cid for cid, v in verdicts.items() if v == "NOT HELD"]
    print(f"done in {time.perf_counter() - t0:.0f}s" + (f"; NOT HELD: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _cmd_audit_demo(args) -> int:
    missing = _missing_demo_deps(need_sklearn=False)
    if missing:
        print(
            _DEMO_EXTRA_HINT.format(cmd="audit-demo", missing=", ".join(missing), missing_args=" ".join(missing)),
            file=sys.stderr,
        )
        return 2
    from .report.html import check_out_dir

    try:
        check_out_dir(args.out)
    except ValueError as e:
        print(f"lossscale audit-demo: --out {e}", file=sys.stderr)
        return 2
    from .demo.fp32_fallback import run_audit_demo

    summary = run_audit_demo(args.out, quick=args.quick, seed=args.seed)
    print(f"done in {summary['seconds']:.0f}s: {summary['verdict']}")
    return 0 if summary["verdict"] == "HELD" else 1


def _cmd_formats(args) -> int:
    from . import formats

    try:
        f = formats.get(args.cliff)  # before the table: an error is the only output
    except ValueError as e:
        print(f"lossscale formats: --cliff: {e}", file=sys.stderr)
        return 2
    print(formats.table())
    print()
    print(
        f"The {f.name} cliff: |x| <= {f.flush_threshold:.4g} rounds to exactly 0; from there up to "
        f"{f.smallest_normal:.4g} values are subnormal (fewer significant bits, down to "
        f"{f.smallest_subnormal:.4g}); "
        + (
            f"|x| >= {f.overflow_threshold:.6g} overflows to inf."
            if f.has_inf and f.overflow_tie_overflows
            else f"|x| > {f.overflow_threshold:.6g} overflows."
        )
    )
    print(f"A gradient of 1e-8 in {f.name}: {formats.round_to(f, 1e-8):g}; of 1e-4: {formats.round_to(f, 1e-4):.6g}.")
    return 0


def _cmd_report(args) -> int:
    missing = _missing_demo_deps(need_sklearn=False)
    if missing:
        print(
            _DEMO_EXTRA_HINT.format(cmd="report", missing=", ".join(missing), missing_args=" ".join(missing)),
            file=sys.stderr,
        )
        return 2
    import warnings

    from .report.html import check_out_dir
    from .report.run_report import render_run_report, steps_text

    try:
        check_out_dir(args.out)
    except ValueError as e:
        print(f"lossscale report: --out {e}", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = render_run_report(args.jsonl, args.out)
    except (OSError, ValueError) as e:
        print(f"lossscale report: {e}", file=sys.stderr)
        return 2
    for w in caught:  # e.g. skipped bad lines: one line each, without the source location
        print(f"lossscale report: warning: {w.message}", file=sys.stderr)
    print(
        f"{steps_text(summary)}, {summary['skipped_steps']} skipped, scale {summary['scale_first']:g} -> "
        f"{summary['scale_last']:g} ({summary['backoffs']} backoffs, {summary['growths']} growths"
        + (" between records)" if summary["records"] != summary["steps"] else ")")
        + (f"; {summary['bad_lines']} bad line(s) skipped" if summary.get("bad_lines") else "")
    )
    print(f"report: {args.out}/index.html")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``lossscale`` and ``python -m lossscale``; returns the exit status.

    A bare ``lossscale`` prints the help and succeeds (as ``--help`` does). When the reader of stdout
    goes away (``lossscale formats | head -2``) the command stops quietly with status 141, as a
    program killed by SIGPIPE would, instead of printing a BrokenPipeError traceback.
    """
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)  # --help and usage errors exit from here
            if args.command is None:
                parser.print_help()
                return 0
            return {"demo": _cmd_demo, "audit-demo": _cmd_audit_demo, "formats": _cmd_formats, "report": _cmd_report}[
                args.command
            ](args)
        finally:
            sys.stdout.flush()  # here, where a closed pipe can be caught, not at interpreter exit
    except BrokenPipeError:
        # Python flushes stdout again at exit and would fail again: point it at devnull first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _SIGPIPE_STATUS


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
