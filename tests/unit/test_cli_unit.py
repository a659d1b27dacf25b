"""The CLI's argument handling and the report's stage bookkeeping (resume, failure, skip), on tiny models."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny, random_tokens

from mechgeom import report
from mechgeom.analyses.contribution.stats import add_sums, finish_sums, score_sums
from mechgeom.cli import build_parser, main
from mechgeom.models import list_models

FAST = ("contributions", "taxonomy")  # the cheapest stages keep these tests well under a second each
ORIGINAL_STAGES = report.STAGES


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nope"],
        ["report", "--n-texts", "0"],
        ["report", "--n-texts", "two"],
        ["report", "--seq-len", "1"],
        ["report", "--seed", "-1"],
        ["report", "--corpus", "not-a-corpus"],
        ["report", "--model", "gpt-9"],
        ["contributions", "--text", "a", "--out", "x.csv", "--model", "gpt-9"],
        ["report", "--unknown-flag"],
        ["contributions", "--out", "x.csv"],  # neither --text nor --file
        ["contributions", "--text", "a", "--file", "f.txt", "--out", "x.csv"],
        ["contributions", "--text", "a"],  # no --out
        ["contributions", "--text", "a", "--out", "x.txt"],  # unknown format
        ["contributions", "--text", "a", "--out", "x.csv", "--layer", "-1"],
        ["contributions", "--file", "does/not/exist.txt", "--out", "x.csv"],
    ],
)
def test_bad_arguments_are_argparse_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: mechgeom" in err and "error:" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "tasks", "--out", "x", "--n-items", "two"], "expected a positive integer, got 'two'"),
        (["sweep", "tasks", "--out", "x", "--workers", "0"], "expected a positive integer, got 0"),
        (["sweep", "faithfulness", "--out", "x", "--seq-len", "1"], "--seq-len must be at least 2"),
        (["sweep", "faithfulness", "--out", "x", "--rates", "0,1.5"], "--rates must be in [0, 1]"),
        (["sweep", "faithfulness", "--out", "x", "--metrics", "cosine"], "--metrics: ['cosine'] not in"),
        (["sweep", "pruning", "--out", "x", "--layers", "0,x"], "--layers: expected integers"),
    ],
)
def test_sweep_options_share_the_run_verbs_argument_types(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_pointing_at_a_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "taken.txt"
    f.write_text("not a directory")
    with pytest.raises(SystemExit) as exc:
        main(["report", "--quick", "--out", str(f)])
    assert exc.value.code == 2
    assert "is an existing file" in capsys.readouterr().err
    assert f.read_text() == "not a directory"  # untouched
    with pytest.raises(NotADirectoryError, match="existing file"):
        report.build_report(f, model=make_tiny(), tokens=random_tokens(1, 6))
    d = tmp_path / "dir.csv"
    d.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["contributions", "--text", "hi", "--out", str(d)])
    assert exc.value.code == 2


def test_models_lists_the_offline_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == list_models()
    assert "smollm2-135m" in out


def test_report_defaults_follow_the_presets() -> None:
    args = build_parser().parse_args(["report"])
    assert (args.model, args.corpus, args.out, args.quick) == (
        "smollm2-135m",
        "wikitext2",
        Path("out/report"),
        False,
    )
    assert args.n_texts is None and args.seq_len is None  # filled from PRESETS by build_report
    assert report.PRESETS["quick"]["n_texts"] * report.PRESETS["quick"]["seq_len"] < (
        report.PRESETS["default"]["n_texts"] * report.PRESETS["default"]["seq_len"]
    )


# --------------------------------------------------------------------------- the report's own numbers


def test_score_summary_matches_python_loops() -> None:
    g = torch.Generator().manual_seed(0)
    b, h, n = 2, 3, 6
    a = torch.rand(b, h, n, n, generator=g).tril()
    a = a / a.sum(-1, keepdim=True)
    vn = torch.rand(b, h, n, n, generator=g).tril()
    c = (torch.randn(b, h, n, n, generator=g) * 0.5 + a).tril()
    c[1, 2, 4] = float("nan")  # a zero-norm row: skipped, never a crash
    c[1, 2, 4, 5] = 0.0  # (above the diagonal it is 0, as ContributionResult stores it)
    got = finish_sums(score_sums(a, vn, c))
    for hh in range(h):
        sink_a, neg, tot, agree, tv, n_q, n_c = [], 0, 0, 0, [], 0, []
        for bb in range(b):
            for i in range(1, n):
                sink_a.append(float(a[bb, hh, i, 0]))
                row_c = [float(c[bb, hh, i, j]) for j in range(i + 1)]
                row_a = [float(a[bb, hh, i, j]) for j in range(i + 1)]
                top_a = max(range(i + 1), key=lambda j: (row_a[j], -j))
                if any(math.isnan(x) for x in row_c):
                    continue
                n_q += 1
                n_c.append(row_c[0])
                neg += sum(x < 0 for x in row_c)
                tot += i + 1
                agree += top_a == max(range(i + 1), key=lambda j: (row_c[j], -j))
                tv.append(0.5 * sum(abs(x - y) for x, y in zip(row_c, row_a, strict=True)))
        assert got["sink_attention"][hh] == pytest.approx(sum(sink_a) / len(sink_a), rel=1e-6)
        assert got["sink_contribution"][hh] == pytest.approx(sum(n_c) / len(n_c), rel=1e-6)
        assert got["negative_share"][hh] == pytest.approx(neg / tot, rel=1e-6)
        assert got["tv_attention_contribution"][hh] == pytest.approx(sum(tv) / len(tv), rel=1e-5)
        assert got["top1_agreement"][hh] == pytest.approx(agree / n_q, rel=1e-6)


def test_score_sums_add_up_over_batches() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.rand(5, 2, 7, 7, generator=g).tril()
    a = a / a.sum(-1, keepdim=True)
    vn, c = torch.rand(5, 2, 7, 7, generator=g).tril(), torch.randn(5, 2, 7, 7, generator=g).tril()
    c[3, 1, 2] = float("nan")
    whole = finish_sums(score_sums(a, vn, c))
    acc = None
    for sl in (slice(0, 2), slice(2, 3), slice(3, 5)):
        acc = add_sums(acc, score_sums(a[sl], vn[sl], c[sl]))
    assert acc is not None
    for k, v in finish_sums(acc).items():
        torch.testing.assert_close(v, whole[k], msg=k)


def test_contributions_stage_streams_batches(tmp_path: Path) -> None:
    # 6 texts = two batches of the stage: one row per (layer, head), equal to the one-pass summary.
    import pandas as pd

    from mechgeom import contribution_weights

    model, tokens = make_tiny(), random_tokens(6, 8)
    report.build_report(tmp_path, model=model, tokens=tokens, stages=["contributions"], verbose=False)
    df = pd.read_csv(tmp_path / "contributions.csv")
    assert len(df) == 2 * 4 and not df.duplicated(["layer", "head"]).any()
    res = contribution_weights(model, tokens, layers=[1])
    direct = finish_sums(
        score_sums(*(res.intra[k][:, 0] for k in ("attention", "value_weighted_normalized", "contribution")))
    )
    got = df[df["layer"] == 1].sort_values("head")
    for k, v in direct.items():
        assert got[k].to_numpy() == pytest.approx(v.numpy(), rel=1e-5, abs=1e-7), k


def _faith_frame(comp: list[float], suff: list[float]) -> Any:
    import pandas as pd

    metrics = ["attention", "value_weighted", "value_weighted_normalized", "contribution"]
    rows = [
        {"mode": mode, "metric": m, "rate": 0.0, "delta_ppl": 0.0}
        for mode in ("comprehensiveness", "sufficiency")
        for m in metrics
    ]
    for mode, vals in (("comprehensiveness", comp), ("sufficiency", suff)):
        for m, v in zip(metrics, vals, strict=True):
            rows += [
                {"mode": mode, "metric": m, "rate": r, "delta_ppl": v + d}
                for r, d in ((0.3, -1.0), (0.6, 1.0))
            ]
    return pd.DataFrame(rows), metrics


def test_faithfulness_order_verdicts() -> None:
    frame, metrics = _faith_frame([1, 2, 3, 4], [4, 3, 2, 1])
    comp, suff = report.faithfulness_order(frame, metrics)
    assert comp.endswith("holds here.") and suff.endswith("holds here.")
    assert "most faithful first: contribution (+4) > value_weighted_normalized (+3)" in comp
    assert "most faithful first: contribution (+1) > value_weighted_normalized (+2)" in suff
    frame, _ = _faith_frame([1, 2, 2, 4], [4, 3, 3, 1])
    comp, suff = report.faithfulness_order(frame, metrics)
    assert (
        "holds up to ties (value_weighted = value_weighted_normalized" in comp and "holds up to ties" in suff
    )
    frame, _ = _faith_frame([4, 2, 3, 1], [4, 3, 2, 1])
    comp, suff = report.faithfulness_order(frame, metrics)
    assert comp.endswith("does not hold here.") and suff.endswith("holds here.")


def test_spread_layers() -> None:
    assert report.spread_layers(30, 4) == [0, 10, 19, 29]
    assert report.spread_layers(2, 4) == [0, 1]


# --------------------------------------------------------------------------- stage bookkeeping


def _counting_stages(
    monkeypatch: pytest.MonkeyPatch, calls: Counter[str], fail: dict[str, BaseException]
) -> None:
    """Wrap every stage's run in a counter; a stage named in ``fail`` raises that exception instead."""

    def wrap(stage: report.Stage) -> report.Stage:
        inner = stage.run

        def run(ctx: Any, p: dict[str, Any]) -> report.StageOutput:
            calls[stage.name] += 1
            if stage.name in fail:
                raise fail[stage.name]
            return inner(ctx, p)

        return dataclasses.replace(stage, run=run)

    monkeypatch.setattr(report.build, "STAGES", tuple(wrap(s) for s in ORIGINAL_STAGES))


def _row(out: Path, name: str) -> dict[str, Any] | None:
    """The stage store's row of ``name`` (its settings and params decoded), or None."""
    rows = report.stage_store(out).rows()
    rows = rows[rows["stage"] == name] if len(rows) else rows
    assert len(rows) <= 1  # one row per stage
    if not len(rows):
        return None
    row = rows.iloc[0].to_dict()
    return {**row, "settings": json.loads(row["settings"]), "params": json.loads(row["params"])}


def _tiny_report(out: Path, **kw: Any) -> report.ReportResult:
    kw.setdefault("tokens", random_tokens(2, 10, seed=1))
    return report.build_report(out, model=make_tiny(n_kv=2), stages=FAST, verbose=False, **kw)


def test_interrupted_report_resumes_without_recomputing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    _counting_stages(monkeypatch, calls, {"taxonomy": KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        _tiny_report(tmp_path)
    assert _row(tmp_path, "contributions") is not None
    assert _row(tmp_path, "taxonomy") is None
    assert "status pending" in (tmp_path / "report.html").read_text()  # the page written after stage 1
    first = (tmp_path / "contributions.csv").read_bytes()
    mtime = (tmp_path / "stages" / "contributions.html").stat().st_mtime_ns

    calls.clear()
    _counting_stages(monkeypatch, calls, {})
    res = _tiny_report(tmp_path)
    assert calls == Counter({"taxonomy": 1})  # contributions was loaded, not recomputed
    assert res.status() == {"contributions": "reused", "taxonomy": "computed"}
    assert (tmp_path / "stages" / "contributions.html").stat().st_mtime_ns == mtime
    assert _row(tmp_path, "contributions") is not None and _row(tmp_path, "taxonomy") is not None
    assert (tmp_path / "contributions.csv").read_bytes() == first
    page = (tmp_path / "report.html").read_text()
    assert "status pending" not in page and page.count("<section") == 2
    assert (tmp_path / "taxonomy.csv").is_file() and (tmp_path / "figures" / "taxonomy_regimes.png").is_file()

    calls.clear()
    res = _tiny_report(tmp_path)  # a third run reuses everything and loads nothing
    assert calls == Counter() and set(res.status().values()) == {"reused"}


def test_checkpoints_live_under_out_and_nothing_else_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Path] = []
    inner = next(s for s in ORIGINAL_STAGES if s.name == "taxonomy")

    def run(ctx: Any, p: dict[str, Any]) -> report.StageOutput:
        seen.append(ctx.partial_path("sweep", ".csv"))
        return inner.run(ctx, p)

    monkeypatch.setattr(report.build, "STAGES", (dataclasses.replace(inner, run=run),))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "out"
    report.build_report(
        out, model=make_tiny(), tokens=random_tokens(1, 8), stages=["taxonomy"], verbose=False
    )
    assert seen and seen[0].parent == out / "partial" and seen[0].name.startswith("sweep-")
    assert list(cwd.iterdir()) == []
    assert not (out / "partial").exists()  # removed once the stage is done and left nothing there


def test_changed_settings_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    _counting_stages(monkeypatch, calls, {})
    _tiny_report(tmp_path)
    _tiny_report(tmp_path, seed=3)  # another seed: another key
    _tiny_report(tmp_path, seed=3, tokens=random_tokens(2, 10, seed=2))  # other tokens: another key
    assert calls == Counter({"contributions": 3, "taxonomy": 3})
    meta = _row(tmp_path, "taxonomy")
    assert (
        meta is not None
        and meta["settings"]["seed"] == 3
        and meta["settings"]["corpus"].startswith("tokens:")
    )


def test_a_missing_file_forces_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    _counting_stages(monkeypatch, calls, {})
    _tiny_report(tmp_path)
    (tmp_path / "taxonomy.csv").unlink()
    _tiny_report(tmp_path)
    assert calls == Counter({"contributions": 1, "taxonomy": 2})


def test_failed_stage_is_reported_and_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    _counting_stages(monkeypatch, calls, {"contributions": RuntimeError("boom")})
    res = _tiny_report(tmp_path)
    assert res.status() == {"contributions": "failed", "taxonomy": "computed"} and not res.ok
    page = (tmp_path / "report.html").read_text()
    assert "RuntimeError: boom" in page and "failed" in page
    calls.clear()
    _counting_stages(monkeypatch, calls, {})
    res = _tiny_report(tmp_path)
    assert calls == Counter({"contributions": 1}) and res.ok


def test_missing_module_is_skipped_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stages = tuple(
        dataclasses.replace(s, module="mechgeom.not_there") if s.name == "taxonomy" else s
        for s in ORIGINAL_STAGES
    )
    monkeypatch.setattr(report.build, "STAGES", stages)
    res = _tiny_report(tmp_path)
    assert res.status()["taxonomy"] == "skipped"
    assert "not available: the module mechgeom.not_there" in (tmp_path / "report.html").read_text()
    assert _row(tmp_path, "taxonomy") is None


def test_unknown_stage_and_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown stage"):
        report.build_report(tmp_path, model=make_tiny(), tokens=random_tokens(1, 6), stages=["nope"])
    with pytest.raises(ValueError, match="unknown corpus"):
        report.build_report(tmp_path, model=make_tiny(), corpus="nope")
    with pytest.raises(ValueError, match="seq_len"):
        report.build_report(tmp_path, model=make_tiny(), n_texts=2, seq_len=1)


def test_report_page_is_self_contained(tmp_path: Path) -> None:
    _tiny_report(tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?https?:", page, re.I)
    assert not re.search(r"@import\s+url\(\s*[\"']?https?:", page, re.I)
    assert "unpkg.com" not in page and "sourceMappingURL" not in page
    assert page.count("var CircuitsVis=") == 1  # the bundle once, however many views
    assert page.count("CircuitsVis.render(") >= 1
    assert page.count("data:image/png;base64,") == 2  # contributions heatmaps + taxonomy grid
    for stem in ("contributions", "contributions_layers", "taxonomy", "taxonomy_regimes"):
        assert (tmp_path / f"{stem}.csv").is_file()


def test_contributions_html_inlines_the_bundle_once(tmp_path: Path) -> None:
    from mechgeom import contribution_weights

    model = make_tiny(n_kv=2)
    res = contribution_weights(model, random_tokens(1, 7), layers=[0, 1], intra=["attention", "contribution"])
    page = report.contributions_html(res, tmp_path / "all.html").read_text()
    assert (
        page.count("var CircuitsVis=") == 1 and page.count("CircuitsVis.render(") == 2
    )  # one layer view each
    assert not re.search(r"<script[^>]*\bsrc\s*=", page) and "unpkg.com" not in page
    two = report.contributions_html(res, tmp_path / "two.html", heads=[1, 3]).read_text()
    assert two.count("CircuitsVis.render(") == 4 and "L1H3" in two  # one head view per (layer, head)
    with pytest.raises(IndexError):
        report.contributions_html(res, tmp_path / "bad.html", heads=[4])
    assert not (tmp_path / "bad.html").exists()


# --------------------------------------------------------------------------- a light command line


def test_help_imports_no_heavy_module() -> None:
    """``python -m mechgeom --help`` (and ``run``/``sweep`` help) builds the whole parser without importing
    torch, pandas, numpy, matplotlib or TransformerLens: a verb's modules load only when it runs."""
    import subprocess
    import sys

    heavy = ("torch", "pandas", "numpy", "matplotlib", "transformer_lens", "mechgeom.models", "mechgeom.data")
    code = (
        "import runpy, sys\n"
        "sys.argv = ['mechgeom', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('mechgeom', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print('LOADED', sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    for argv in (["--help"], ["run", "sinks", "--help"], ["sweep", "tasks", "--help"]):
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert "usage: mechgeom" in done.stdout, done.stdout
        assert done.stdout.strip().splitlines()[-1] == "LOADED []", (argv, done.stdout[-300:])


def test_the_command_lines_name_lists_are_the_librarys() -> None:
    """The static lists of :mod:`mechgeom.report.options` (the parser's choices) equal the library's."""
    from mechgeom.analyses import faithfulness
    from mechgeom.analyses.heads import orders
    from mechgeom.data import CORPORA, TASKS
    from mechgeom.hooks import MODES
    from mechgeom.report import options

    assert list(options.MODELS) == list_models()
    assert (options.CORPORA, options.TASKS) == (CORPORA, TASKS)
    assert options.FAITHFULNESS_METRICS == faithfulness.FAITHFULNESS_METRICS
    assert options.DEFAULT_RATES == faithfulness.DEFAULT_RATES and options.MODES == MODES
    assert options.HEAD_ORDERS == orders.ORDERS and options.RETENTION_LEVELS == orders.RETENTION_LEVELS
    assert report.PRESETS is options.PRESETS


# --------------------------------------------------------------------------- one driver per analysis


def test_run_sinks_and_the_report_stage_are_one_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mechgeom run sinks`` and the report's sinks stage on the same tiny model and windows: the same
    statistics, the same ablation, and the same convexity heads, spread from the strongest sink head (of
    layers >= 1) to the weakest."""
    import pandas as pd

    from mechgeom import data, models
    from mechgeom.analyses.sinks.statistics import sink_statistics

    model, tokens = make_tiny(n_layers=3, seed=21), random_tokens(2, 10, seed=22)
    monkeypatch.setattr(models, "load_model", lambda name, **kw: model)
    monkeypatch.setattr(data, "load_corpus", lambda corpus, m, *, n_texts, seq_len, seed: tokens[:n_texts])
    argv = ["run", "sinks", "--n-texts", "2", "--seq-len", "10", "--per-layer-texts", "0", "--modes", "zero"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    run = tmp_path / "run" / "smollm2-135m"
    report.build_report(tmp_path / "rep", model=model, tokens=tokens, stages=["sinks"], verbose=False)
    rep = tmp_path / "rep"
    pd.testing.assert_frame_equal(pd.read_csv(run / "heads.csv"), pd.read_csv(rep / "sinks.csv"))
    pd.testing.assert_frame_equal(
        pd.read_csv(run / "ablation_all_layers_zero.csv"), pd.read_csv(rep / "sinks_ablation.csv")
    )
    heads = json.loads((run / "summary.json").read_text())["convexity_check_heads"]
    measured = pd.read_csv(rep / "sinks_convexity.csv")
    assert list(dict.fromkeys(zip(measured["layer"], measured["head"], strict=True))) == [
        tuple(h) for h in heads
    ]
    rates = (
        sink_statistics(model, tokens)
        .to_frame()
        .query("layer >= 1")
        .set_index(["layer", "head"])["sink_rate"]
    )
    assert len(heads) == 3 and tuple(heads[0]) == rates.idxmax() and tuple(heads[-1]) == rates.idxmin()
