"""The report on the sweep engine: killed mid-way (SIGKILL), resumed without lost or duplicated stage rows."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import make_tiny, random_tokens

from mechgeom import report
from mechgeom.sweep import RowStore

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
STAGES = ("contributions", "selection", "taxonomy")


def _counted(calls: Counter[str]) -> tuple[report.Stage, ...]:
    def wrap(stage: report.Stage) -> report.Stage:
        inner = stage.run

        def run(ctx: Any, p: dict[str, Any]) -> report.StageOutput:
            calls[stage.name] += 1
            return inner(ctx, p)

        return dataclasses.replace(stage, run=run)

    return tuple(wrap(s) for s in report.STAGES)


def _store_rows(out: Path) -> pd.DataFrame:
    return report.stage_store(out).rows()


def test_report_resumes_after_sigkill_without_lost_or_duplicated_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "rep"
    script = f"""
        import dataclasses, sys, time
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import make_tiny, random_tokens
        from mechgeom import report

        def slow(stage):
            inner = stage.run
            def run(ctx, p):
                if stage.name == "selection":
                    time.sleep(60)  # killed here, after contributions has its row
                return inner(ctx, p)
            return dataclasses.replace(stage, run=run)

        report.build.STAGES = tuple(slow(s) for s in report.STAGES)
        report.build_report({str(out)!r}, model=make_tiny(n_kv=2), tokens=random_tokens(2, 10, seed=1),
                            stages={STAGES!r}, verbose=False)
    """
    store_path = out / "stages" / "stages.csv"
    log = tmp_path / "killed.stderr"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script)],
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 120
        while not (store_path.exists() and len(pd.read_csv(store_path)) >= 1):
            if proc.poll() is not None:
                pytest.fail(f"the report exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the first stage never finished")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    killed = _store_rows(out)
    assert killed["stage"].tolist() == ["contributions"]
    first_table = (out / "contributions.csv").read_bytes()

    calls: Counter[str] = Counter()
    monkeypatch.setattr(report.build, "STAGES", _counted(calls))
    kw: dict[str, Any] = {"stages": STAGES, "verbose": False}
    res = report.build_report(out, model=make_tiny(n_kv=2), tokens=random_tokens(2, 10, seed=1), **kw)
    assert calls == Counter({"selection": 1, "taxonomy": 1})  # contributions came from the store
    assert res.status() == {"contributions": "reused", "selection": "computed", "taxonomy": "computed"}
    assert (out / "contributions.csv").read_bytes() == first_table
    resumed = _store_rows(out)
    assert sorted(resumed["stage"]) == sorted(STAGES) and not resumed.duplicated(["stage", "key"]).any()

    # the same report in one uninterrupted run: the same stage keys and the same tables
    full_out = tmp_path / "full"
    report.build_report(full_out, model=make_tiny(n_kv=2), tokens=random_tokens(2, 10, seed=1), **kw)
    full = _store_rows(full_out)
    cols = ["stage", "key", "settings", "params", "files"]
    pd.testing.assert_frame_equal(
        resumed[cols].sort_values("stage").reset_index(drop=True),
        full[cols].sort_values("stage").reset_index(drop=True),
    )
    for stem in ("contributions", "selection", "taxonomy", "taxonomy_regimes"):
        pd.testing.assert_frame_equal(pd.read_csv(out / f"{stem}.csv"), pd.read_csv(full_out / f"{stem}.csv"))


def test_a_store_of_another_layout_is_refused(tmp_path: Path) -> None:
    RowStore(tmp_path / "stages" / "stages.csv", key=["stage", "key"], settings={"store_version": 1}).add(
        [{"stage": "contributions", "key": "kold"}]
    )
    with pytest.raises(ValueError, match=r"store_version: stored 1, now 2.*delete the report folder"):
        report.build_report(tmp_path, model=make_tiny(), tokens=random_tokens(1, 8), stages=["taxonomy"])
    assert not (tmp_path / "taxonomy.csv").exists()  # refused before anything was computed


def test_other_settings_replace_the_stage_row(tmp_path: Path) -> None:
    tiny = make_tiny()
    report.build_report(tmp_path, model=tiny, tokens=random_tokens(1, 8), stages=["taxonomy"], verbose=False)
    report.build_report(
        tmp_path, model=tiny, tokens=random_tokens(1, 8), stages=["taxonomy"], seed=4, verbose=False
    )
    rows = _store_rows(tmp_path)
    assert rows["stage"].tolist() == ["taxonomy"]  # one row per stage: the files are the latest run's
    assert json.loads(rows["settings"].iloc[0])["seed"] == 4


def test_sinks_and_taxonomy_stages_share_one_pass_equal_to_the_entry_points(tmp_path, monkeypatch):
    import mechgeom
    from mechgeom.hooks import readers

    model, toks = make_tiny(n_layers=2, n_kv=2, seed=6), random_tokens(3, 10, seed=2)
    settings = report.ReportSettings("tiny", "wikitext", 3, 10, 0, True)
    ctx = report.StageContext(settings, tmp_path, model=model, tokens=toks, verbose=False)
    forwards = []
    real = readers.run_hooks
    monkeypatch.setattr(readers, "run_hooks", lambda *a, **k: forwards.append(1) or real(*a, **k))
    got = ctx.sinks_and_labels(3, [0])
    assert ctx.sinks_and_labels(3, [0]) is got and len(forwards) == 1  # one batch, one forward, kept
    monkeypatch.setattr(readers, "run_hooks", real)
    sinks = mechgeom.sink_statistics(model, toks, sink_positions=[0])
    labels = mechgeom.classify_heads(model, toks, sink_positions=[0], corpus="wikitext")
    pd.testing.assert_frame_equal(got["sinks"].to_frame(), sinks.to_frame())
    pd.testing.assert_frame_equal(got["taxonomy"].to_frame(), labels.to_frame())
    assert ctx.sinks_and_labels(2, [0])["sinks"].sink_rate.shape[0] == 2  # other texts: another pass
