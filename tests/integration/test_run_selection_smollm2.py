"""``mechgeom run selection`` on SmolLM2-135M: the files of ``results/selection/<model>/`` and a summary.json
that agrees with ``token_selection(...).summary()`` and ``classify_heads(...).summary()`` on the same windows."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from mechgeom.analyses.heads.taxonomy import classify_heads
from mechgeom.analyses.selection.collector import token_selection
from mechgeom.cli import main
from mechgeom.data import load_corpus

pytestmark = pytest.mark.integration

FILES = (
    "selection_heads.csv",
    "selection_by_n.csv",
    "sink_effect.csv",
    "bound_params.csv",
    "bound_by_n.csv",
    "taxonomy_wikitext2.csv",
    "taxonomy_c4.csv",
    "taxonomy_distribution.csv",
    "taxonomy_regimes.csv",
    "taxonomy_agreement.csv",
    "summary.json",
    "selection_f_vs_n.png",
    "taxonomy_regimes.png",
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


def test_run_selection_writes_the_files_and_the_summary(smollm2, tmp_path):
    argv = ["run", "selection", "--n-texts", "1", "--seq-len", "24", "--ns", "1", "2", "4"]
    argv += ["--n-random", "1", "--query-stride", "2", "--corpora", "wikitext2", "c4", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = tmp_path / "smollm2-135m"
    for name in FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())

    tokens = load_corpus("wikitext2", smollm2, n_texts=1, seq_len=24, seed=0)
    res = token_selection(smollm2, tokens, ns=[1, 2, 4], n_random=1, query_stride=2, seed=0)
    want = res.summary()
    assert want.keys() <= summary.keys()
    for key, value in want.items():
        assert _same(summary[key], json.loads(json.dumps(value))), key
    assert summary["model"] == "smollm2-135m" and summary["windows"] == [1, 24]
    assert summary["n_layers"] == 30 and summary["n_heads"] == 9 and summary["query_stride"] == 2
    assert summary["cert_violations"] == 0 and summary["bound_violations"] == 0

    heads = pd.read_csv(out / "selection_heads.csv")
    assert len(heads) == 30 * 9 * 3
    assert heads["f_top"].to_numpy() == pytest.approx(
        res.to_frame()["f_top"].to_numpy(), rel=1e-6, nan_ok=True
    )
    by_n = pd.read_csv(out / "selection_by_n.csv")
    assert by_n["N"].tolist() == [1, 2, 4]
    assert by_n["f_gap"].to_numpy() == pytest.approx(res.by_n_frame()["f_gap"].to_numpy(), rel=1e-6)

    tax = classify_heads(smollm2, tokens, corpus="wikitext2").summary()
    assert _same(summary["taxonomy"]["wikitext2"], json.loads(json.dumps(tax)))
    assert summary["regime_shares"]["wikitext2"] == pytest.approx(tax["shares"])
    assert summary["retriever_share"]["wikitext2"] == pytest.approx(tax["shares"]["Retriever"])
    assert set(summary["regime_shares"]) == {"wikitext2", "c4"}
    assert summary["agreement"]["pairwise"][0]["n_heads"] == 270
    table = pd.read_csv(out / "taxonomy_wikitext2.csv")
    assert len(table) == 270 and (table["corpus"] == "wikitext2").all()
