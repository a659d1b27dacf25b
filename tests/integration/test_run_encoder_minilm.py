"""``mechgeom run encoder`` on MiniLM (small sizes): the files of ``results/encoder/<model>/`` and a
summary.json whose numbers are those of the analyses run again here on the same windows."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import require_minilm

from mechgeom.analyses.faithfulness.embedding import embedding_curves
from mechgeom.analyses.sinks.statistics import sink_statistics
from mechgeom.cli import main
from mechgeom.data import CORPORA, load_corpus
from mechgeom.models import load_model

pytestmark = pytest.mark.integration

FILES = (
    "sinks_heads.csv",
    "sinks_by_corpus.csv",
    "special_tokens.csv",
    "faithfulness.csv",
    "faithfulness_curves.png",
    "summary.json",
)


def test_run_encoder_writes_its_files_and_the_analyses_numbers(tmp_path) -> None:
    require_minilm()
    argv = ["run", "encoder", "--out", str(tmp_path), "--n-texts", "3", "--seq-len", "32"]
    argv += ["--faithfulness-texts", "2", "--rates", "0", "0.5", "--batch-size", "2"]
    assert main(argv) == 0
    out = tmp_path / "minilm-l6"
    for name in FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    by_corpus = pd.read_csv(out / "sinks_by_corpus.csv")
    assert sorted(by_corpus["corpus"].unique()) == sorted(CORPORA)
    assert set(by_corpus["sink"]) == {"[CLS]", "[SEP]"}

    model = load_model("minilm-l6")
    windows = load_corpus(CORPORA[0], model, n_texts=3, seq_len=32, seed=0)
    stats = sink_statistics(model, windows, sink_positions=["[CLS]", "[SEP]"], batch_size=2)
    frame = stats.to_frame()
    for sink in ("[CLS]", "[SEP]"):
        row = by_corpus[(by_corpus["corpus"] == CORPORA[0]) & (by_corpus["sink"] == sink)].iloc[0]
        want = frame[frame["sink"] == sink]
        for col in ("sink_rate_pos", "norm_ratio_vt", "cos_sink_tokens"):
            assert row[col] == pytest.approx(want[col].mean(), rel=1e-5), (sink, col)

    curves = embedding_curves(model, windows[:2], rates=[0.0, 0.5], batch_size=2)
    judged = curves.summary()["modes"]
    for mode, result in summary["faithfulness"]["modes"].items():
        assert result["verdict"] == judged[mode]["verdict"]
        for (m1, a1), (m2, a2) in zip(result["ranking"], judged[mode]["ranking"], strict=True):
            assert m1 == m2 and a1 == pytest.approx(a2, rel=1e-5, abs=1e-9)
