"""The report's driver: the stages as work items of the sweep engine (:mod:`mechgeom.sweep`).

Each stage is one :class:`~mechgeom.sweep.Item` keyed by ``(stage, key)``, where ``key`` hashes the report
settings and the stage's parameters. Its row in the :class:`~mechgeom.sweep.RowStore`
``out_dir/stages/stages.csv`` records the settings, the parameters, the files it wrote and its time; the
rendered section sits beside it in ``stages/<stage>.html``. A stage is reused when its row is stored and its
files are present; it is computed otherwise, and its earlier row (other settings) is dropped first, so each
stage has at most one row and the files on disk always belong to the row that names them. A report over other
settings thus recomputes the stages it needs (a model object also by its weights, so an edited model does not
reuse them); a store written by another version of this layout is refused (the store's fingerprint). The store
is locked while the report runs, so a second report on the same folder stops at once, naming the first's PID.
The work of a stage writes its own files under ``out_dir``, so the report always runs on the local executor.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from mechgeom._io import atomic_write, write_frame
from mechgeom.report.base import (
    PRESETS,
    ReportResult,
    ReportSettings,
    Stage,
    StageContext,
    StageOutput,
    StageRecord,
    logger,
)
from mechgeom.report.encoder_stages import DECODER_ONLY, ENCODER_STAGES
from mechgeom.report.html import figure_png, page_html, render_fragment
from mechgeom.report.stages import STAGES
from mechgeom.sweep import Item, LocalExecutor, RowStore, run_sweep, weights_digest

__all__ = ["STORE_VERSION", "build_report", "stage_store"]

#: The layout of ``stages/stages.csv`` (its fingerprint): a store of another layout is refused.
STORE_VERSION = 2

_STORE_KEY = ["stage", "key"]


def _json_roundtrip(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True))


def _module_missing(module: str) -> str | None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"the module {module} is not part of this mechgeom installation"


def stage_store(out_dir: str | Path) -> RowStore:
    """The report's stage store, ``out_dir/stages/stages.csv`` (one row per finished stage)."""
    return RowStore(
        Path(out_dir) / "stages" / "stages.csv",
        key=_STORE_KEY,
        settings={"store_version": STORE_VERSION},
        what="report stage store",
        fresh="delete the report folder or choose another --out",
    )


def _stage_key(settings: dict[str, Any], params: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps([settings, params], sort_keys=True).encode()).hexdigest()[:12]
    return f"k{digest}"  # a letter first, so a CSV round trip keeps it a string


def _stored(store: RowStore, stage: Stage) -> pd.DataFrame:
    rows = store.rows()
    return rows[rows["stage"].astype(str) == stage.name] if len(rows) else rows


def _load_record(out_dir: Path, store: RowStore, stage: Stage, key: str) -> StageRecord | None:
    """The stored record of ``stage`` under ``key``, or None if absent or its files are gone."""
    rows = _stored(store, stage)
    if len(rows) and key not in set(rows["key"].astype(str)):
        logger.info("%s: settings differ from the previous run in %s; recomputing", stage.name, out_dir)
        return None
    if not len(rows):
        return None
    row = rows[rows["key"].astype(str) == key].iloc[0]
    files = [str(f) for f in json.loads(str(row["files"]))]
    fragment = out_dir / "stages" / f"{stage.name}.html"
    missing = [f for f in files if not (out_dir / f).is_file()]
    if missing or not fragment.is_file():
        logger.info("%s: files of the previous run are missing (%s); recomputing", stage.name, missing[:3])
        return None
    return StageRecord(
        stage.name, stage.title, "reused", float(row["seconds"]), files, fragment.read_text(encoding="utf-8")
    )


def _save_stage(out_dir: Path, stage: Stage, out: StageOutput, seconds: float) -> StageRecord:
    """Write a stage's tables, figures and section (each atomically); its store row is written after."""
    files: list[str] = []
    for stem, df in out.tables.items():
        rel = f"{stem}.csv"
        write_frame(df, out_dir / rel)
        files.append(rel)
    pngs: dict[str, bytes] = {}
    for name, fig in out.figures.items():
        png = fig if isinstance(fig, bytes) else figure_png(fig)
        rel = f"figures/{name}.png"
        with atomic_write(out_dir / rel, "wb") as f:
            f.write(png)
        files.append(rel)
        pngs[name] = png
    out.figures = pngs
    fragment = render_fragment(stage, out, files, seconds)
    with atomic_write(out_dir / "stages" / f"{stage.name}.html") as f:
        f.write(fragment)
    return StageRecord(stage.name, stage.title, "computed", seconds, files, fragment)


class _StageWork:
    """The work of one stage item: run it, write its files, return its store row (driver-side only)."""

    def __init__(
        self, ctx: StageContext, out_dir: Path, stage: Stage, settings: dict[str, Any], params: dict[str, Any]
    ) -> None:
        self.ctx, self.out_dir, self.stage = ctx, out_dir, stage
        self.settings, self.params = settings, params
        self.record: StageRecord | None = None

    def __call__(self, model: Any, item: Item) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        result = self.stage.run(self.ctx, self.params)
        self.record = _save_stage(self.out_dir, self.stage, result, time.perf_counter() - t0)
        return [
            {
                "stage": self.stage.name,
                "key": item.key[1],
                "settings": json.dumps(self.settings, sort_keys=True),
                "params": json.dumps(self.params, sort_keys=True),
                "files": json.dumps(self.record.files),
                "seconds": round(self.record.seconds, 2),
            }
        ]


def _write_page(
    out_dir: Path, settings: ReportSettings, records: list[StageRecord], pending: Sequence[Stage]
) -> Path:
    path = out_dir / "report.html"
    with atomic_write(path) as f:
        f.write(page_html(settings, records, pending))
    return path


def _not_for(name: str, encoder: bool) -> str:
    """Why the stage ``name`` does not run on this kind of model."""
    if encoder:
        return f"encoder model: {DECODER_ONLY.get(name, 'a decoder stage')}"
    return "decoder model: this stage is for encoders (bidirectional attention, a sentence embedding)"


def _model_label(model: Any) -> str:
    if isinstance(model, str):
        return model
    return str(getattr(model.cfg, "model_name", type(model).__name__))


def _settings(
    model: Any, corpus: str, n_texts: int | None, seq_len: int | None, seed: int, quick: bool, tokens: Any
) -> ReportSettings:
    """The report's settings, checked; ``tokens`` given stand for the corpus (their hash names it)."""
    from mechgeom.data import CORPORA

    if tokens is None and corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {list(CORPORA)}")
    preset = PRESETS["quick" if quick else "default"]
    if tokens is not None:
        n_texts, seq_len = int(tokens.shape[0]), int(tokens.shape[1])
        corpus = "tokens:" + hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:12]
    n_texts = preset["n_texts"] if n_texts is None else int(n_texts)
    seq_len = preset["seq_len"] if seq_len is None else int(seq_len)
    if n_texts <= 0 or seq_len < 2:
        raise ValueError(f"need n_texts >= 1 and seq_len >= 2, got {n_texts} and {seq_len}")
    return ReportSettings(_model_label(model), corpus, n_texts, seq_len, seed, quick)


def _plan(model: Any, stages: Sequence[str] | None) -> tuple[list[Stage], list[StageRecord]]:
    """The stages to run for this kind of model (all, or those named) and the records of the other
    kind's stages named (all of the decoder's on an encoder), skipped with the reason."""
    from mechgeom.models import is_encoder, is_encoder_name

    encoder = is_encoder_name(model) if isinstance(model, str) else is_encoder(model)
    catalogue = ENCODER_STAGES if encoder else STAGES
    known = list(dict.fromkeys(s.name for s in (*STAGES, *ENCODER_STAGES)))
    if stages is not None:
        unknown = sorted(set(stages) - set(known))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; choose from {known}")
    selected = [s for s in catalogue if stages is None or s.name in set(stages)]
    others = [s for s in (STAGES if encoder else ENCODER_STAGES) if s.name not in {c.name for c in catalogue}]
    wanted = {s.name for s in others} if stages is None and encoder else set(stages or ())
    skipped = [
        StageRecord(s.name, s.title, "skipped", reason=_not_for(s.name, encoder))
        for s in others
        if s.name in wanted
    ]
    return selected, skipped


def _compute(
    ctx: StageContext, store: RowStore, stage: Stage, key: dict[str, Any], params: dict[str, Any], tag: str
) -> StageRecord:
    """Run ``stage`` as one item of the sweep engine (its files written, its store row replaced); a stage
    that raises gives a failed record."""
    stage_key = _stage_key(key, params)
    ctx.stage_key = stage_key.removeprefix("k")
    store.discard((stage.name, str(k_)) for k_ in _stored(store, stage)["key"])  # one row per stage
    work = _StageWork(ctx, ctx.out_dir, stage, key, params)
    t0 = time.perf_counter()
    try:
        run_sweep(
            [Item(key=(stage.name, stage_key), rows=((stage.name, stage_key),))],
            work,
            store,
            executor=LocalExecutor(),
            verbose=False,
        )
    except Exception as exc:
        logger.error("%s: failed: %s", tag, exc)
        logger.debug("%s", traceback.format_exc())
        return StageRecord(
            stage.name, stage.title, "failed", time.perf_counter() - t0, reason=f"{type(exc).__name__}: {exc}"
        )
    assert work.record is not None
    with contextlib.suppress(OSError):  # only if the stage left no checkpoint behind
        (ctx.out_dir / "partial").rmdir()
    return work.record


def build_report(
    out_dir: str | Path = "out/report",
    *,
    model: Any = "smollm2-135m",
    corpus: str = "wikitext2",
    n_texts: int | None = None,
    seq_len: int | None = None,
    seed: int = 0,
    quick: bool = False,
    device: str = "cpu",
    verbose: bool = True,
    tokens: torch.Tensor | None = None,
    stages: Sequence[str] | None = None,
) -> ReportResult:
    """Run every stage (or those named in ``stages``) and write ``out_dir/report.html`` and the tables.

    Args:
        out_dir: the output folder (created); an existing *file* there is an error.
        model: an offline model name (see :func:`mechgeom.list_models`) or an already loaded
            ``HookedTransformer`` (then pass ``tokens`` too if it has no tokenizer).
        corpus: a corpus of :data:`mechgeom.data.CORPORA`.
        n_texts, seq_len: the analysis windows; default :data:`PRESETS` (``quick`` or ``default``).
        seed: window sampling seed.
        quick: the small preset and the stages' small settings (fewer rates, layers and heads).
        device: where the model runs (not part of the resume key).
        verbose: inner progress bars (stage lines are always logged at INFO).
        tokens: ``[n_texts, seq_len]`` windows to use instead of the corpus (their hash joins the key).
        stages: names of the stages to run (default: all of :data:`STAGES`, or for an encoder model all of
            :data:`~mechgeom.report.encoder_stages.ENCODER_STAGES`, the decoder-only stages being listed as
            skipped with the reason).

    Raises:
        NotADirectoryError: ``out_dir`` is an existing file.
        ValueError: unknown stage names, an unknown corpus, non-positive sizes, or a stage store of another
            layout in ``out_dir``.
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 47 lines.
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is an existing file; give a directory for the report")
    settings = _settings(model, corpus, n_texts, seq_len, seed, quick, tokens)
    selected, skipped = _plan(model, stages)
    key = _json_roundtrip(settings.as_dict())
    if not isinstance(model, str):  # a model object may have been edited after loading: its weights count
        key["weights"] = weights_digest(model)
    store = stage_store(out)  # refuses a store of another layout before anything is computed
    ctx = StageContext(
        settings, out, model=None if isinstance(model, str) else model, tokens=tokens, device=device,
        verbose=verbose,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    records: list[StageRecord] = []
    t_all = time.perf_counter()
    with store.writing():  # one report writes the folder at a time: a second one stops here
        for k, stage in enumerate(selected, 1):
            tag = f"[{k}/{len(selected)}] {stage.name}"
            missing = _module_missing(stage.module)
            if missing is not None:
                logger.info("%s: not available (%s)", tag, missing)
                rec = StageRecord(stage.name, stage.title, "skipped", reason=missing)
            else:
                params = _json_roundtrip(stage.params(settings))
                stored = _load_record(out, store, stage, _stage_key(key, params))
                if stored is not None:
                    logger.info("%s: reused from %s", tag, store.path)
                    rec = stored
                else:
                    logger.info("%s: computing ...", tag)
                    _ = (
                        ctx.tokens
                    )  # loading errors (model, corpus) stop the report rather than fail every stage
                    rec = _compute(ctx, store, stage, key, params, tag)
                    if rec.status == "computed":
                        logger.info("%s: done in %.1f s", tag, rec.seconds)
            records.append(rec)
            store.write_table()  # stages.csv follows the stages (written atomically)
            if rec.status in ("computed", "failed"):
                _write_page(out, settings, records, selected[k:])
    for rec in skipped:
        logger.info("%s: skipped (%s)", rec.name, rec.reason)
    records += skipped
    path = _write_page(out, settings, records, [])
    logger.info("report written to %s (%.1f s)", path, time.perf_counter() - t_all)
    return ReportResult(out, path, settings, records)
