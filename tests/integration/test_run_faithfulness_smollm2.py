"""``mechgeom run faithfulness`` on the real SmolLM2-135M: a tiny run through :func:`mechgeom.cli.main` writes the
tables, figures and summary, and its numbers are those of the analysis entry points called directly."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pytest
import torch

from mechgeom.analyses.faithfulness import area_ordering, faithfulness_summary
from mechgeom.analyses.faithfulness.curves import MODES, perplexity_curves, task_accuracy_curves
from mechgeom.cli import main
from mechgeom.data import load_corpus, load_task

pytestmark = pytest.mark.integration

METRICS = ["contribution", "random"]


def _same(a: Any, b: Any) -> None:
    """Nested dicts and lists equal, floats up to 1e-6 (relative)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)
    else:
        assert a == b


def test_run_faithfulness_through_the_cli(smollm2, tmp_path, capsys) -> None:
    out = tmp_path / "results"
    argv = [
        "run",
        "faithfulness",
        "--out",
        str(out),
        "--n-texts",
        "2",
        "--seq-len",
        "24",
        "--corpora",
        "wikitext2",
        "--metrics",
        *METRICS,
        "--rates",
        "0",
        "0.5",
        "--batch-size",
        "2",
        "--task-items",
        "1",
        "--tasks",
        "winogrande",
        "--task-metrics",
        "random",
        "--task-rates",
        "0",
        "0.5",
        "--task-max-len",
        "64",
        "--quiet",
    ]
    threads = torch.get_num_threads()
    assert main(argv) == 0
    assert torch.get_num_threads() == threads  # the verb's --threads does not leak into the caller
    assert capsys.readouterr().out == ""  # logs go to stderr, nothing is printed
    root = out / "smollm2-135m"
    names = ["ppl_wikitext2", "ppl_wikitext2.per_text", "tasks", "tasks.per_choice"]
    for name in [*(f"{n}.csv" for n in names), "ppl_wikitext2.png", "tasks.png", "summary.json"]:
        assert (root / name).is_file(), name
    for png in ("ppl_wikitext2.png", "tasks.png"):
        assert (root / png).read_bytes()[:4] == b"\x89PNG"

    # the numbers are the entry points' own
    tokens = load_corpus("wikitext2", smollm2, n_texts=2, seq_len=24, seed=0)
    direct = perplexity_curves(smollm2, tokens, METRICS, [0.0, 0.5], MODES, batch_size=2, seed=0)
    table = pd.read_csv(root / "ppl_wikitext2.csv")
    pd.testing.assert_frame_equal(table, direct, check_dtype=False, rtol=1e-6)
    items = load_task("winogrande", n=1, seed=0)
    tasks = task_accuracy_curves(
        smollm2, items, ["random"], [0.0, 0.5], ["comprehensiveness"], batch_size=4, seed=0, max_len=64
    )
    pd.testing.assert_frame_equal(pd.read_csv(root / "tasks.csv"), tasks, check_dtype=False, rtol=1e-6)

    summary = json.loads((root / "summary.json").read_text())
    entry = summary["corpora"]["wikitext2"]
    assert entry["n_texts"] == 2 and entry["seq_len"] == 24 and entry["metrics"] == METRICS
    assert entry["clean_ppl"] == pytest.approx(float(direct["clean_ppl"].iloc[0]), rel=1e-9)
    _same(entry["claimed_order"], faithfulness_summary(direct, claimed=["contribution"]))
    _same(entry["ordering"], area_ordering(direct, "delta_ppl"))
    _same(entry["ordering_by_delta_nll"], area_ordering(direct, "delta_nll"))
    assert summary["tasks"]["clean_accuracy"] == {"winogrande": float(tasks["clean_accuracy"].iloc[0])}

    # a rerun resumes from the finished records (no masked pass) and writes the same tables
    record = pd.read_csv(root / "ppl_wikitext2.per_text.csv")
    assert main(argv) == 0
    pd.testing.assert_frame_equal(pd.read_csv(root / "ppl_wikitext2.csv"), table)
    pd.testing.assert_frame_equal(pd.read_csv(root / "ppl_wikitext2.per_text.csv"), record)
