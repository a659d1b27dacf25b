"""``mechgeom run sinks`` on SmolLM2-135M: the files of ``results/sinks/<model>/`` and a summary.json that
agrees with the analysis' own ``summary()`` methods on the same windows."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from mechgeom.analyses.sinks.statistics import sink_statistics, spread_sink_heads
from mechgeom.cli import main
from mechgeom.data import load_corpus

pytestmark = pytest.mark.integration

FILES = (
    "heads.csv",
    "convexity_check.csv",
    "ablation_all_layers_zero.csv",
    "ablation_summary.csv",
    "summary.json",
    "rate_vs_ratio.png",
    "convexity_curves.png",
    "s_star_vs_rate.png",
    "cone_shift.png",
)


def _same(a, b) -> bool:
    """Equal JSON values; NaN equals NaN."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return (
            isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def test_run_sinks_writes_the_files_and_the_summary(smollm2, tmp_path):
    argv = ["run", "sinks", "--n-texts", "2", "--seq-len", "16", "--per-layer-texts", "0", "--modes", "zero"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = tmp_path / "smollm2-135m"
    for name in FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())

    tokens = load_corpus("wikitext2", smollm2, n_texts=2, seq_len=16, seed=0)
    stats = sink_statistics(smollm2, tokens)
    want = stats.summary()
    assert want.keys() <= summary.keys()
    for key, value in want.items():
        assert _same(summary[key], json.loads(json.dumps(value))), key
    assert summary["model"] == "smollm2-135m" and summary["n_texts"] == 2 and summary["seq_len"] == 16
    assert summary["n_heads"] == 30 * 9 and summary["sink_positions"] == [0]

    heads = pd.read_csv(out / "heads.csv")
    assert len(heads) == 30 * 9
    assert heads["sink_rate"].to_numpy() == pytest.approx(stats.to_frame()["sink_rate"].to_numpy(), rel=1e-9)

    chosen = spread_sink_heads(stats)
    assert summary["convexity_check_heads"] == [list(h) for h in chosen]
    assert summary["convexity_check_max_abs_err"] < 1e-4
    conv = pd.read_csv(out / "convexity_check.csv")
    assert list(conv.columns) == ["layer", "head", "s", "max_abs_err"] and len(conv) == 3 * 6

    abl = pd.read_csv(out / "ablation_summary.csv")
    assert abl["scope"].tolist() == ["all layers"] and abl["mode"].tolist() == ["zero"]
    assert [row["scope"] for row in summary["ablation"]] == ["all layers"]
    assert summary["ablation"][0]["dppl_sink"] == pytest.approx(float(abl["dppl_sink"].iloc[0]), rel=1e-9)
