"""The command line's vocabulary, light enough for ``mechgeom --help``: the names its options accept, the
report's presets, the options every ``mechgeom run`` and ``mechgeom sweep`` verb shares, and the argument
types (each parses one option's text or raises ``argparse.ArgumentTypeError`` naming what is accepted).

The name lists are static copies of the library's (:func:`mechgeom.models.list_models`,
:data:`mechgeom.data.CORPORA`, the faithfulness metrics, modes and rates, the head orders and retention
levels), so building the parser imports neither torch nor a model; ``tests/unit/test_cli_unit.py`` checks
that they agree.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = [
    "CORPORA",
    "DEFAULT_RATES",
    "FAITHFULNESS_METRICS",
    "HEAD_ORDERS",
    "MODELS",
    "MODES",
    "PRESETS",
    "RETENTION_LEVELS",
    "TASKS",
    "common_arguments",
    "layer_list",
    "names",
    "non_negative",
    "positive",
    "rates",
    "seq_len",
]

#: The offline models (:func:`mechgeom.models.list_models`).
MODELS = ("smollm2-135m", "gemma-3-270m", "minilm-l6")
#: The shipped corpora and tasks (:data:`mechgeom.data.CORPORA`, :data:`mechgeom.data.TASKS`).
CORPORA = ("wikitext2", "gsm8k", "c4")
TASKS = ("boolq", "winogrande", "mmlu")
#: The faithfulness metrics compared by default, the masking modes and the removal rates
#: (:mod:`mechgeom.analyses.faithfulness`).
FAITHFULNESS_METRICS = ("attention", "value_weighted", "value_weighted_normalized", "contribution", "random")
MODES = ("comprehensiveness", "sufficiency")
DEFAULT_RATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: The head orders of the pruning curves and their retention levels (:mod:`mechgeom.analyses.heads.orders`).
HEAD_ORDERS = ("taxonomy", "magnitude", "entropy", "random", "single_head")
RETENTION_LEVELS = tuple(k / 10 for k in range(10, 0, -1))

#: Sizes of the report's analysis corpus: ``--quick`` and the default run.
PRESETS: dict[str, dict[str, int]] = {
    "quick": {"n_texts": 2, "seq_len": 64},
    "default": {"n_texts": 8, "seq_len": 128},
}


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def seq_len(text: str) -> int:
    value = positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError("--seq-len must be at least 2 (one next-token prediction)")
    return value


def names(allowed: tuple[str, ...], what: str) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [n for n in names if n not in allowed]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"{what}: {bad or text!r} not in {', '.join(allowed)}")
        return names

    return parse


def rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates: expected numbers like 0,0.1,0.5, got {text!r}") from None
    if not rates or any(not 0 <= r <= 1 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates must be in [0, 1], got {text!r}")
    return rates


def layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers: expected integers like 0,5,29, got {text!r}") from None


def common_arguments(
    parser: argparse.ArgumentParser,
    *,
    out: str | None,
    batch_size: int | None,
    threads: int = 1,
    model: str = "smollm2-135m",
) -> None:
    """The options of every run and sweep verb: ``--model``, ``--out`` (``None``: a required directory),
    ``--seed``, ``--batch-size`` (``None``: each analysis' own) and ``--threads``."""
    parser.add_argument("--model", default=model, choices=MODELS, help=f"offline model (default {model})")
    if out is None:
        parser.add_argument(
            "--out", type=Path, required=True, help="directory of the tables and resume records"
        )
    else:
        parser.add_argument(
            "--out", type=Path, default=Path(out), help=f"output root (default {out}); files go to OUT/MODEL/"
        )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--batch-size", type=positive, default=batch_size, help="texts per forward pass")
    parser.add_argument(
        "--threads", type=positive, default=threads, help=f"torch threads (default {threads})"
    )
