"""``mechgeom <verb>``: the command line.

- ``mechgeom report``: every analysis on one model and corpus -> ``DIR/report.html`` (offline, one file)
  plus one table per analysis; rerunning with the same settings reuses the finished stages.
- ``mechgeom contributions``: contribution weights of one text -> CSV, Parquet or HTML (by ``--out``'s suffix).
- ``mechgeom run <analysis>``: one full analysis (faithfulness, sinks, selection, pruning) on one model ->
  ``results/<analysis>/<model>/`` (tables, figures, ``summary.json``); ``scripts/run_*.py`` wrap these verbs.
- ``mechgeom sweep <sweep>``: one resumable sweep (faithfulness, tasks, pruning) -> ``--out DIR``, on this
  process or on Ray actors (``--engine ray``); the same table either way.
- ``mechgeom models``: the offline models.

Logs go to stderr; results (paths, model names) to stdout. :func:`main` returns the exit status, so it can
be called from Python: ``main(["models"])``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from mechgeom import __version__
from mechgeom.report import sweeps
from mechgeom.report.options import CORPORA, MODELS, PRESETS, non_negative, positive, seq_len
from mechgeom.report.runs import RUNS, run_module

__all__ = ["build_parser", "main"]

logger = logging.getLogger("mechgeom")

_TABLE_SUFFIXES = (".csv", ".parquet", ".html")


def _report_parser(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    q, d = PRESETS["quick"], PRESETS["default"]
    rep = verbs.add_parser(
        "report",
        help="run every analysis and write one offline HTML report plus tables",
        description=(
            "Run every analysis (contribution weights vs attention, faithfulness curves, sinks and convexity, "
            "selection geometry, head taxonomy, pruning) and write DIR/report.html (self-contained, renders "
            "offline) plus one CSV per analysis. A rerun with the same settings reuses finished stages."
        ),
    )
    rep.add_argument(
        "--model", default="smollm2-135m", choices=MODELS, help="offline model (default smollm2-135m)"
    )
    rep.add_argument(
        "--corpus", default="wikitext2", choices=CORPORA, help="text corpus (default: wikitext2)"
    )
    rep.add_argument(
        "--n-texts",
        type=positive,
        default=None,
        help=f"number of token windows (default {d['n_texts']}; --quick {q['n_texts']})",
    )
    rep.add_argument(
        "--seq-len",
        type=seq_len,
        default=None,
        help=f"tokens per window (default {d['seq_len']}; --quick {q['seq_len']})",
    )
    rep.add_argument(
        "--out", type=Path, default=Path("out/report"), help="output directory (default out/report)"
    )
    rep.add_argument("--device", default="cpu", help="torch device (default cpu)")
    rep.add_argument("--seed", type=non_negative, default=0, help="window sampling seed (default 0)")
    rep.add_argument("--quick", action="store_true", help="small sizes: a smoke run in about a minute")
    rep.add_argument(
        "--no-progress", action="store_true", help="no progress bars (stage lines are still logged)"
    )


def _contributions_parser(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    con = verbs.add_parser(
        "contributions",
        help="contribution weights of one text as CSV, Parquet or HTML",
        description=(
            "Contribution weights and their baselines (docs/definitions.md §2) of one text. The format follows --out's "
            "suffix: .csv or .parquet (one row per layer, head, query, source), .html (circuitsvis views of "
            "attention and contribution weights, self-contained)."
        ),
    )
    src = con.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to analyse")
    src.add_argument("--file", type=Path, help="a UTF-8 text file to analyse")
    con.add_argument("--out", type=Path, required=True, help="output file: .csv, .parquet or .html")
    con.add_argument(
        "--model", default="smollm2-135m", choices=MODELS, help="offline model (default smollm2-135m)"
    )
    con.add_argument("--layer", type=non_negative, nargs="+", default=None, help="layer(s) (default: all)")
    con.add_argument("--head", type=non_negative, nargs="+", default=None, help="head(s) (default: all)")
    con.add_argument("--device", default="cpu", help="torch device (default cpu)")


def _run_parser(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    run = verbs.add_parser(
        "run",
        help="one full analysis on one model, written under results/<analysis>/<model>/",
        description="One full analysis on one model: tables, figures and summary.json under --out/<model>/.",
    )
    analyses = run.add_subparsers(dest="analysis", required=True, metavar="{" + ",".join(RUNS) + "}")
    for name in RUNS:
        module = run_module(name)
        sub = analyses.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)


def _sweep_parser(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sw = verbs.add_parser(
        "sweep",
        help="a resumable sweep (faithfulness, tasks, pruning) on this process or on Ray actors",
        description=sweeps.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweeps.add_arguments(
        sw.add_subparsers(dest="sweep", required=True, metavar="{" + ",".join(sweeps.SWEEPS) + "}")
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mechgeom`` (one sub-command per verb). It imports only the light modules
    of the command line (:mod:`mechgeom.report.options`, the verbs' option definitions): no torch."""
    parser = argparse.ArgumentParser(
        prog="mechgeom",
        description="Geometry-aware attention analysis on TransformerLens (offline models and data).",
    )
    parser.add_argument("--version", action="version", version=f"mechgeom {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging (tracebacks of failed stages)"
    )
    verbs = parser.add_subparsers(
        dest="verb", required=True, metavar="{report,contributions,run,sweep,models}"
    )
    _report_parser(verbs)
    _contributions_parser(verbs)
    _run_parser(verbs)
    _sweep_parser(verbs)
    verbs.add_parser(
        "models", help="list the offline models", description="List the offline models, one per line."
    )
    return parser


def _setup_logging(verbose: bool) -> logging.Handler:
    """A stderr handler on the ``mechgeom`` logger for the duration of one :func:`main` call."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mechgeom: %(message)s"))
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    return handler


def _cmd_models(args: argparse.Namespace) -> int:
    for (
        name
    ) in MODELS:  # mechgeom.models.list_models(), without importing torch (a test checks the two agree)
        print(name)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from mechgeom.report.build import build_report

    result = build_report(
        args.out,
        model=args.model,
        corpus=args.corpus,
        n_texts=args.n_texts,
        seq_len=args.seq_len,
        seed=args.seed,
        quick=args.quick,
        device=args.device,
        verbose=not args.no_progress,
    )
    print(result.html_path)
    failed = [s.name for s in result.stages if s.status == "failed"]
    skipped = [
        f"{s.name} ({s.reason})" if s.reason else s.name for s in result.stages if s.status == "skipped"
    ]
    if skipped:
        logger.warning("skipped: %s", "; ".join(skipped))
    if failed:
        logger.error("failed stage(s): %s; rerun the same command to retry them", ", ".join(failed))
        return 1
    return 0


def _cmd_contributions(args: argparse.Namespace) -> int:
    from mechgeom.analyses.contribution.weights import contribution_weights
    from mechgeom.hooks.validation import resolve_heads, resolve_layers
    from mechgeom.models import load_model

    text = args.text if args.text is not None else args.file.read_text(encoding="utf-8")
    model = load_model(args.model, device=args.device)
    layers = resolve_layers(model, args.layer)
    heads = resolve_heads(model, args.head)
    result = contribution_weights(model, text, layers=layers)
    suffix = args.out.suffix.lower()
    if suffix == ".html":
        from mechgeom.report.html import contributions_html

        contributions_html(result, args.out, heads=heads)
    else:
        from mechgeom._io import write_frame

        write_frame(result.to_frame(batch=0, layers=layers, heads=heads), args.out)
    print(args.out)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    return int(run_module(args.analysis).run(args))


def _cmd_sweep(args: argparse.Namespace) -> int:
    print(sweeps.run(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mechgeom`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Argument errors raise ``SystemExit(2)`` (argparse); a bad ``--out`` or an analysis error returns 2 or 1
    with the reason logged to stderr.
    """
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    if args.verb == "contributions":
        if args.out.suffix.lower() not in _TABLE_SUFFIXES:
            parser.error(f"--out must end in one of {', '.join(_TABLE_SUFFIXES)}, got {str(args.out)!r}")
        if args.out.is_dir():
            parser.error(
                f"--out {args.out} is a directory; give a file name ending in .csv, .parquet or .html"
            )
        if args.file is not None and not args.file.is_file():
            parser.error(f"--file {args.file} does not exist")
    if args.verb == "report" and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is an existing file; give a directory for the report")
    level = logger.level
    handler = _setup_logging(args.verbose)
    commands = {
        "models": _cmd_models,
        "report": _cmd_report,
        "contributions": _cmd_contributions,
        "run": _cmd_run,
        "sweep": _cmd_sweep,
    }
    try:
        return commands[args.verb](args)
    except (ValueError, TypeError, IndexError, ImportError, OSError) as exc:
        logger.error("%s", exc)
        logger.debug("traceback:", exc_info=True)
        return 2 if isinstance(exc, (ValueError, TypeError, IndexError)) else 1
    except KeyboardInterrupt:
        logger.error("interrupted; finished stages are kept: rerun the same command to resume")
        return 130
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
