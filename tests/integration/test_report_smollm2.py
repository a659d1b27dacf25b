"""``mechgeom report --quick`` and ``mechgeom contributions`` on the offline SmolLM2.

The quick report is built once per session (shared with ``test_browser.py``) the hard way: the first run
is interrupted at the selection stage (a stage wrapper raises ``KeyboardInterrupt``, as Ctrl-C would),
then the same command is run again with every stage's ``run`` counted. The tests below check what each
run did and what the folder holds. Building it takes one to two minutes on two cores (``slow``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from mechgeom import report
from mechgeom.cli import main

pytestmark = pytest.mark.integration

INTERRUPT_AT = "selection"
STAGE_NAMES = [s.name for s in report.STAGES]
FINISHED_BEFORE = STAGE_NAMES[: STAGE_NAMES.index(INTERRUPT_AT)]

EXPECTED_FILES = [
    "report.html",
    "contributions.csv",
    "contributions_layers.csv",
    "faithfulness.csv",
    "sinks.csv",
    "sinks_convexity.csv",
    "sinks_ablation.csv",
    "selection.csv",
    "selection_params.csv",
    "taxonomy.csv",
    "taxonomy_regimes.csv",
    "taxonomy_agreement.csv",
    "pruning.csv",
    "figures/contributions_heatmaps.png",
    "figures/faithfulness_curves.png",
    "figures/sinks_rate_vs_ratio.png",
    "figures/sinks_rate_vs_s_star.png",
    "figures/sinks_convexity.png",
    "figures/sinks_cone_shift.png",
    "figures/selection_f_scores.png",
    "figures/taxonomy_regimes.png",
    "figures/pruning_retention.png",
    "stages/stages.csv",
    *[f"stages/{name}.html" for name in STAGE_NAMES],
]


def _with_counters(calls: Counter[str], interrupt: str | None) -> tuple[report.Stage, ...]:
    def wrap(stage: report.Stage) -> report.Stage:
        inner = stage.run

        def run(ctx: Any, p: dict[str, Any]) -> report.StageOutput:
            calls[stage.name] += 1
            if stage.name == interrupt:
                raise KeyboardInterrupt
            return inner(ctx, p)

        return dataclasses.replace(stage, run=run)

    return tuple(wrap(s) for s in report.STAGES)


def quick_report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ``--quick`` report folder: built by an interrupted run plus a resumed run, once."""
    out = tmp_path_factory.getbasetemp() / "mechgeom-quick-report"
    log = out.parent / "mechgeom-quick-report.runs.json"
    if log.is_file():
        return out
    argv = ["report", "--quick", "--no-progress", "--out", str(out)]
    first: Counter[str] = Counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report.build, "STAGES", _with_counters(first, INTERRUPT_AT))
        rc_first = main(argv)
    mtimes = {n: (out / "stages" / f"{n}.html").stat().st_mtime_ns for n in FINISHED_BEFORE}
    second: Counter[str] = Counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report.build, "STAGES", _with_counters(second, None))
        rc_second = main(argv)
    after = {n: (out / "stages" / f"{n}.html").stat().st_mtime_ns for n in FINISHED_BEFORE}
    log.write_text(
        json.dumps(
            {"rc": [rc_first, rc_second], "first": first, "second": second, "mtimes_kept": mtimes == after}
        )
    )
    return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = quick_report_dir(tmp_path_factory)
    return out, json.loads((out.parent / "mechgeom-quick-report.runs.json").read_text())


@pytest.mark.slow  # the session's quick report takes one to two minutes
def test_interrupted_run_resumes_without_recomputing(quick: tuple[Path, dict[str, Any]]) -> None:
    _, runs = quick
    assert runs["rc"] == [130, 0]  # Ctrl-C -> 130 with a resume hint; the rerun succeeds
    assert runs["first"] == {name: 1 for name in [*FINISHED_BEFORE, INTERRUPT_AT]}
    # the rerun computes only the unfinished stages; the finished ones are loaded from their markers
    assert runs["second"] == {name: 1 for name in STAGE_NAMES if name not in FINISHED_BEFORE}
    assert runs["mtimes_kept"]


@pytest.mark.slow  # the session's quick report takes one to two minutes
def test_quick_report_writes_every_file(quick: tuple[Path, dict[str, Any]]) -> None:
    out, _ = quick
    missing = [f for f in EXPECTED_FILES if not (out / f).is_file()]
    assert missing == []
    assert not (out / "partial").exists()  # sweep checkpoints are cleaned up once a stage is done
    for f in EXPECTED_FILES:
        if f.endswith(".png"):
            assert 2_000 < (out / f).stat().st_size < 300_000, f
    for name in STAGE_NAMES:
        rows = report.stage_store(out).rows()
        assert (rows["stage"] == name).sum() == 1  # one row per stage
        meta = rows[rows["stage"] == name].iloc[0].to_dict()
        meta["settings"] = json.loads(meta["settings"])
        meta["files"] = json.loads(meta["files"])
        assert meta["settings"] == {
            "model": "smollm2-135m",
            "corpus": "wikitext2",
            "n_texts": 2,
            "seq_len": 64,
            "seed": 0,
            "quick": True,
        }
        assert all((out / f).is_file() for f in meta["files"])


@pytest.mark.slow  # the session's quick report takes one to two minutes
def test_quick_report_html_is_complete_and_offline(quick: tuple[Path, dict[str, Any]]) -> None:
    out, _ = quick
    page = (out / "report.html").read_text(encoding="utf-8")
    assert (
        '<script src="http' not in page and '<link href="http' not in page and "@import url(http" not in page
    )
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)\s*=\s*[\"']?(https?:)?//", page, re.I)
    assert "unpkg.com" not in page
    assert page.count("var CircuitsVis=") == 1
    for name in STAGE_NAMES:
        assert re.search(rf'<section id="{name}"><h2>[^<]*<span class="status (computed|reused)"', page), name
    assert "status failed" not in page and "status skipped" not in page and "status pending" not in page
    assert page.count("data:image/png;base64,") == 9
    assert len(page) < 4_000_000


@pytest.mark.slow  # the session's quick report takes one to two minutes
def test_quick_report_numbers_are_sane(quick: tuple[Path, dict[str, Any]]) -> None:
    out, _ = quick
    con = pd.read_csv(out / "contributions.csv")
    assert len(con) == 30 * 9 and set(con["layer"]) == set(range(30))
    assert con["sink_attention"].between(0, 1).all()
    assert (con["negative_share"] > 0).any()  # contribution weights can be negative on SmolLM2
    faith = pd.read_csv(out / "faithfulness.csv")
    assert set(faith["rate"]) == {0.0, 0.3, 0.6}
    assert set(faith["metric"]) == {
        "attention",
        "value_weighted",
        "value_weighted_normalized",
        "contribution",
        "random",
    }
    assert (faith.loc[faith["rate"] == 0, "delta_ppl"].abs() < 1e-6).all()
    comp = faith[(faith["mode"] == "comprehensiveness") & (faith["rate"] == 0.6)]
    assert (comp["delta_ppl"] > 0).all()  # removing 60% of the top sources must hurt
    sel = pd.read_csv(out / "selection.csv")
    assert sel["cert_violations"].sum() == 0 and sel["bound_violations"].sum() == 0
    tax = pd.read_csv(out / "taxonomy.csv")
    assert len(tax) == 270 and set(tax["label"]) <= {"Retriever", "Mixer", "Reset"}
    prune = pd.read_csv(out / "pruning.csv")
    assert set(prune["order"]) == {"taxonomy", "magnitude", "entropy", "random"}
    full = prune[prune["retention"] == 1.0]
    assert (full["delta_ppl"].abs() < 1e-9).all()
    conv = pd.read_csv(out / "sinks_convexity.csv")
    err = (conv["norm_measured"] - conv["norm_closed_form"]).abs() / conv["norm_closed_form"]
    assert err.max() < 1e-3


@pytest.mark.slow  # the session's quick report takes one to two minutes
def test_rerun_is_instant_and_stdout_is_the_path(
    quick: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = quick
    calls: Counter[str] = Counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report.build, "STAGES", _with_counters(calls, None))
        assert main(["report", "--quick", "--no-progress", "--out", str(out)]) == 0
    assert calls == Counter()
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out / "report.html")
    assert "[1/6] contributions: reused" in captured.err


# --------------------------------------------------------------------------- contributions verb


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".html"])
def test_contributions_writes_each_format(
    tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "The cat sat on the mat because it was tired."
    path = tmp_path / f"weights{suffix}"
    assert (
        main(["contributions", "--text", text, "--layer", "3", "7", "--head", "0", "4", "--out", str(path)])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(path)
    if suffix == ".html":
        page = path.read_text(encoding="utf-8")
        assert (
            page.count("var CircuitsVis=") == 1 and page.count("CircuitsVis.render(") == 4
        )  # 2 layers x 2 heads
        assert not re.search(r"<script[^>]*\bsrc\s*=", page) and "unpkg.com" not in page
        assert "Layer 3" in page and "Layer 7" in page
        return
    df = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    n = 11  # SmolLM2 tokens of the text (no BOS)
    assert set(df["layer"]) == {3, 7} and set(df["head"]) == {0, 4}
    assert len(df) == 2 * 2 * n * (n + 1) // 2
    sums = df.groupby(["layer", "head", "query"])["contribution"].sum()
    assert ((sums - 1).abs() < 1e-4).all()  # sum_j c[h,i,j] = 1 (definitions §2.3), via the CLI and the file
    assert df.loc[df["query"] == 0, "key_token"].iloc[0] == "The"


def test_contributions_from_a_file_and_bad_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt"
    src.write_text("Paris is the capital of France.", encoding="utf-8")
    out = tmp_path / "w.csv"
    assert main(["contributions", "--file", str(src), "--layer", "0", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert set(df["head"]) == set(range(9)) and math.isclose(df["attention"].sum(), 9 * 7, rel_tol=1e-4)
    assert (
        main(["contributions", "--text", "hi there", "--layer", "30", "--out", str(tmp_path / "x.csv")]) == 2
    )
    assert "out of range" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
