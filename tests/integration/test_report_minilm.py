"""``mechgeom report --model minilm-l6 --quick``: the encoder's stages run, the decoder-only ones are skipped
with their reason, the numbers in the page are those of the tables, and a rerun reuses every stage."""

from __future__ import annotations

import html
import logging
from pathlib import Path

import pandas as pd
import pytest
from conftest import require_minilm

from mechgeom import report
from mechgeom.cli import main
from mechgeom.report.encoder_stages import DECODER_ONLY, ENCODER_STAGES

pytestmark = pytest.mark.integration

ENCODER_NAMES = [s.name for s in ENCODER_STAGES]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, report.ReportResult]:
    require_minilm()
    out = tmp_path_factory.mktemp("minilm") / "report"
    return out, report.build_report(out, model="minilm-l6", quick=True, verbose=False)


def test_encoder_stages_run_and_decoder_stages_are_skipped_with_the_reason(built) -> None:
    out, res = built
    status = {s.name: s.status for s in res.stages}
    assert [s.name for s in res.stages if s.status == "computed"] == ENCODER_NAMES
    assert {n for n, st in status.items() if st == "skipped"} == set(DECODER_ONLY)
    reasons = {s.name: s.reason for s in res.stages if s.status == "skipped"}
    assert (
        "next-token prediction" in reasons["faithfulness"] and "next-token prediction" in reasons["pruning"]
    )
    assert all(r.startswith("encoder model: ") for r in reasons.values())
    page = (out / "report.html").read_text(encoding="utf-8")
    for name, reason in reasons.items():
        assert html.escape(reason) in page, name
    for f in ("contributions_special_tokens.csv", "sinks.csv", "embedding_faithfulness.csv"):
        assert (out / f).is_file(), f
    assert (out / "figures" / "embedding_curves.png").stat().st_size > 1000


def test_the_page_states_the_tables_numbers(built) -> None:
    out, _ = built
    page = (out / "report.html").read_text(encoding="utf-8")
    sinks = pd.read_csv(out / "sinks.csv")
    assert set(sinks["sink"]) == {"[CLS]", "[SEP]"}
    cls_mass = sinks[sinks["sink"] == "[CLS]"]["sink_rate_pos"].mean()
    assert html.escape(f"[CLS]: attention mass {cls_mass:.3f}") in page
    special = pd.read_csv(out / "contributions_special_tokens.csv")
    cls = special[special["token"] == "[CLS]"]
    assert html.escape(f"[CLS] receives {cls['attention'].mean():.3f} of the attention") in page
    assert html.escape(f"but {cls['contribution'].mean():.3f} of the contribution weight") in page
    curves = pd.read_csv(out / "embedding_faithfulness.csv")
    assert set(curves["mode"]) == {"comprehensiveness", "sufficiency"}
    assert (curves[curves["rate"] == 0]["effect"] == 0).all()
    assert ((curves["effect"] >= 0) & (curves["effect"] <= 2)).all()
    assert html.escape("Paper A's order") in page


def test_a_rerun_reuses_every_stage_and_the_cli_names_the_skips(built, caplog) -> None:
    out, _ = built
    with caplog.at_level(logging.INFO, logger="mechgeom"):
        rc = main(["report", "--model", "minilm-l6", "--quick", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "reused" in caplog.text and "computing" not in caplog.text
    assert "skipped: faithfulness (encoder model: needs next-token prediction" in caplog.text


def test_a_decoder_lists_a_named_encoder_stage_as_skipped(tmp_path: Path) -> None:
    res = report.build_report(
        tmp_path / "r", model="smollm2-135m", stages=["embedding_faithfulness"], verbose=False
    )
    assert [(s.name, s.status) for s in res.stages] == [("embedding_faithfulness", "skipped")]
    assert res.stages[0].reason.startswith("decoder model: ")
    with pytest.raises(ValueError, match="unknown stage"):
        report.build_report(tmp_path / "r2", model="minilm-l6", stages=["nope"])
