"""``mechgeom sweep {faithfulness,tasks,pruning}`` on the real SmolLM2-135M: ``--engine local`` and
``--engine ray`` (2 actors, 1 thread each, on the session's loopback-only cluster) give the same tables row
for row, and the local tables are those of the analysis entry points called directly."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mechgeom.analyses.faithfulness.curves import perplexity_curves, task_accuracy_curves
from mechgeom.analyses.scoring import task_baselines
from mechgeom.cli import main
from mechgeom.data import load_corpus, load_task

pytestmark = pytest.mark.integration

FAITH = "--corpus wikitext2,gsm8k --n-texts 2 --seq-len 16 --metrics attention,contribution --rates 0,0.5"
TASKS = "--tasks winogrande,mmlu --n-items 1 --metrics contribution,random --rates 0,0.6 --max-len 48"
SWEEPS = {
    "faithfulness": (f"{FAITH} --modes comprehensiveness --batch-size 2".split(), "faithfulness.csv"),
    "tasks": (f"{TASKS} --batch-size 6".split(), "tasks.csv"),
    "pruning": (["--n-texts", "1", "--seq-len", "12", "--layers", "29"], "single_head.csv"),
}
KEYS = {"faithfulness": ["corpus", "metric", "mode", "rate"], "tasks": ["task", "metric", "mode", "rate"]}


def _table(path, key):
    return pd.read_csv(path).sort_values(key).reset_index(drop=True)


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_sweep_verb_gives_the_same_table_on_local_and_ray(sweep, smollm2, ray_cluster, tmp_path, capsys):
    (args, name), key = SWEEPS[sweep], KEYS.get(sweep, ["layer", "head"])
    assert main(["sweep", sweep, "--out", str(tmp_path / "local"), "--quiet", *args]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "local" / name)
    ray_args = ["--engine", "ray", "--workers", "2", "--threads", "1"]
    assert main(["sweep", sweep, "--out", str(tmp_path / "ray"), "--quiet", *ray_args, *args]) == 0
    local, ray = _table(tmp_path / "local" / name, key), _table(tmp_path / "ray" / name, key)
    assert len(local) == len(ray) > 0
    pd.testing.assert_frame_equal(local, ray, rtol=1e-5)
    if sweep == "faithfulness":
        assert set(local["corpus"]) == {"wikitext2", "gsm8k"} and "delta_ppl" in local
        assert (tmp_path / "ray" / "faithfulness_gsm8k.per_text.csv").is_file()
        tokens = load_corpus("gsm8k", smollm2, n_texts=2, seq_len=16, seed=0)
        direct = perplexity_curves(
            smollm2, tokens, ("attention", "contribution"), (0.0, 0.5), ("comprehensiveness",), batch_size=2
        )
        got = local[local["corpus"] == "gsm8k"].reset_index(drop=True)
        np.testing.assert_allclose(got["ppl"], direct.sort_values(key[1:])["ppl"], rtol=1e-5)
    if sweep == "tasks":
        items = [*load_task("winogrande", n=1, seed=0), *load_task("mmlu", n=1, seed=0)]
        base = task_baselines(items).set_index("task")
        for task, row in local.groupby("task").first().iterrows():
            assert row["chance"] == pytest.approx(base.loc[task, "chance"])
            assert row["majority"] == pytest.approx(base.loc[task, "majority"])
        direct = task_accuracy_curves(
            smollm2,
            items,
            ("contribution", "random"),
            (0.0, 0.6),
            ("comprehensiveness",),
            max_len=48,
            batch_size=6,
        )
        np.testing.assert_allclose(
            local["accuracy"], direct.sort_values(key).reset_index(drop=True)["accuracy"], rtol=1e-9
        )
    if sweep == "pruning":
        assert set(local["layer"]) == {29} and len(local) == 9
        assert np.isfinite(local["delta_ppl"]).all()
    if sweep == "faithfulness":  # the resume paths of all three are tested in test_sweep_unit/_ray_unit
        # rerunning resumes from the records: the same table; another seed is refused with the difference
        assert main(["sweep", sweep, "--out", str(tmp_path / "ray"), "--quiet", *ray_args, *args]) == 0
        pd.testing.assert_frame_equal(_table(tmp_path / "ray" / name, key), ray)
        assert main(["sweep", sweep, "--out", str(tmp_path / "local"), "--quiet", "--seed", "1", *args]) == 2
        assert "seed: stored 0, now 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [
        ["faithfulness", "--rates", "0,2"],
        ["faithfulness", "--metrics", "attention,nonsense"],
        ["tasks", "--tasks", "boolq,trivia"],
        ["pruning", "--engine", "dask"],
        ["pruning", "--workers", "0"],
    ],
)
def test_sweep_verb_rejects_bad_options(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["sweep", bad[0], "--out", str(tmp_path), *bad[1:]])
    assert err.value.code == 2
    assert "error:" in capsys.readouterr().err
