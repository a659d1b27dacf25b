"""The report: every analysis on one model and corpus, in one offline HTML file plus one table per analysis.

:func:`build_report` runs the stages of :data:`STAGES` in order (contribution weights vs attention,
faithfulness curves, sinks and convexity, selection geometry, head taxonomy, pruning) and writes, under
``out_dir``:

- ``report.html``: one self-contained page that renders offline: figures are embedded as base64 PNG,
  circuitsvis views carry the bundled JavaScript once (``local_src``, no CDN), tables are HTML;
- ``<stage>.csv`` (and a few companion tables): the numbers behind each section;
- ``figures/*.png``: the same figures as files;
- ``stages/<stage>.json`` + ``stages/<stage>.html``: a marker with the stage's settings and its rendered
  section. A rerun with the same settings reuses a stage whose marker and files are present (an
  interrupted run resumes where it stopped); a stage whose settings differ is recomputed.

A stage whose analysis module is not installed is shown as "not available" and skipped; a stage that
raises is shown as failed (the other stages still run) and is recomputed on the next run. Every file goes
through :mod:`mechgeom._io`'s atomic writes, so an interruption never leaves a half-written file.

This module only presents: the numbers come from the analysis modules; the per-head summaries here are
means over their outputs.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import html
import importlib.util
import io
import itertools
import json
import logging
import math
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._io import atomic_write, write_frame
from mechgeom._progress import progress

logger = logging.getLogger(__name__)

__all__ = [
    "PRESETS",
    "STAGES",
    "ReportResult",
    "ReportSettings",
    "Stage",
    "StageOutput",
    "StageRecord",
    "build_report",
    "circuitsvis_bundle",
    "contributions_html",
    "faithfulness_order",
    "figure_png",
    "html_document",
    "strip_circuitsvis_bundle",
]

#: Sizes of the analysis corpus: ``--quick`` and the default run.
PRESETS: dict[str, dict[str, int]] = {
    "quick": {"n_texts": 2, "seq_len": 64},
    "default": {"n_texts": 8, "seq_len": 128},
}

_MARKER_VERSION = 1


# --------------------------------------------------------------------------- settings and results


@dataclass(frozen=True)
class ReportSettings:
    """What a report is computed from; a stage is reused only when these (and its params) match."""

    model: str
    corpus: str
    n_texts: int
    seq_len: int
    seed: int
    quick: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StageOutput:
    """What a stage returns: tables (file stem -> frame), figures (name -> matplotlib figure or PNG
    bytes), summary lines (plain text), extra HTML (circuitsvis views) and notes (plain text)."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    views: list[tuple[str, str]] = field(default_factory=list)  # (caption, circuitsvis local_src)
    notes: list[str] = field(default_factory=list)


@dataclass
class StageRecord:
    """One stage as the report shows it."""

    name: str
    title: str
    status: str  # "computed" | "reused" | "skipped" | "failed"
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    fragment: str = ""
    reason: str = ""


@dataclass
class ReportResult:
    """Where the report went and what each stage did."""

    out_dir: Path
    html_path: Path
    settings: ReportSettings
    stages: list[StageRecord]

    @property
    def ok(self) -> bool:
        return all(s.status != "failed" for s in self.stages)

    def status(self) -> dict[str, str]:
        return {s.name: s.status for s in self.stages}


class _Context:
    """The model and the token windows, loaded on first use (a fully reused report loads nothing)."""

    def __init__(
        self,
        settings: ReportSettings,
        out_dir: Path,
        *,
        model: Any = None,
        tokens: torch.Tensor | None = None,
        device: str = "cpu",
        verbose: bool = True,
    ) -> None:
        self.settings = settings
        self.device = device
        self.verbose = verbose
        self._model = model
        self._tokens = tokens
        self.out_dir = out_dir
        self.stage_key = ""

    def partial_path(self, name: str, suffix: str) -> Path:
        """A checkpoint file of the running stage, tied to its settings (``partial/<name>-<key><suffix>``):
        a sweep that records finished rows there resumes after an interruption."""
        return self.out_dir / "partial" / f"{name}-{self.stage_key}{suffix}"

    @property
    def model(self) -> Any:
        if self._model is None:
            from mechgeom.models import load_model

            t0 = time.perf_counter()
            self._model = load_model(self.settings.model, device=self.device)
            logger.info("loaded %s in %.1f s", self.settings.model, time.perf_counter() - t0)
        return self._model

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            from mechgeom.data import load_corpus

            s = self.settings
            self._tokens = load_corpus(
                s.corpus, self.model, n_texts=s.n_texts, seq_len=s.seq_len, seed=s.seed
            )
        return self._tokens

    def str_tokens(self, row: int = 0) -> list[str]:
        toks = self.tokens[row]
        if getattr(self.model, "tokenizer", None) is None:
            return [f"t{int(t)}" for t in toks]
        return [str(s) for s in self.model.to_str_tokens(toks)]


@dataclass(frozen=True)
class Stage:
    """One section of the report: the module it needs, its settings and the function that runs it."""

    name: str
    title: str
    module: str
    params: Callable[[ReportSettings], dict[str, Any]]
    run: Callable[[_Context, dict[str, Any]], StageOutput]
    description: str = ""


# --------------------------------------------------------------------------- presentation helpers


def figure_png(fig: Any, *, dpi: int = 80) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed afterwards)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    import sys

    if "matplotlib.pyplot" in sys.modules:  # a pyplot figure would otherwise stay open
        sys.modules["matplotlib.pyplot"].close(fig)
    return buf.getvalue()


@functools.cache
def _bundle_source() -> str:
    import circuitsvis

    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    return path.read_text(encoding="utf-8").replace(
        "</script>", ""
    )  # as circuitsvis' render_local inlines it


def circuitsvis_bundle() -> str:
    """circuitsvis' bundled JavaScript (``dist/cdn/iife.js``), as ``render_local`` inlines it.

    Its ``sourceMappingURL`` comment is dropped so that a browser never asks for the map file.
    """
    return re.sub(r"//# sourceMappingURL=\S*\s*$", "", _bundle_source())


def strip_circuitsvis_bundle(view_html: str) -> str:
    """A circuitsvis ``local_src`` without its inlined bundle (the page carries the bundle once)."""
    return view_html.replace(_bundle_source(), "")


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _table_html(df: pd.DataFrame, name: str, max_rows: int = 12) -> str:
    shown = df.head(max_rows).dropna(axis=1, how="all")  # the file keeps every column
    body = shown.to_html(
        index=False, border=0, classes="tbl", float_format=lambda x: f"{x:.4g}", na_rep="nan"
    )
    more = f"first {len(shown)} of {len(df)} rows; " if len(df) > max_rows else ""
    return f'<div class="table"><p class="cap">{more}full table: <code>{_esc(name)}</code></p>{body}</div>'


def _render_fragment(stage: Stage, out: StageOutput, files: list[str], seconds: float) -> str:
    parts = []
    if stage.description:
        parts.append(f'<p class="desc">{_esc(stage.description)}</p>')
    if out.summary:
        parts.append("<ul class='summary'>" + "".join(f"<li>{_esc(s)}</li>" for s in out.summary) + "</ul>")
    for name, png in out.figures.items():
        b64 = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure><img alt="{_esc(name)}" src="data:image/png;base64,{b64}"/>'
            f"<figcaption>{_esc(name)}</figcaption></figure>"
        )
    for caption, view in out.views:
        parts.append(
            f'<div class="view"><p class="cap">{_esc(caption)}</p>{strip_circuitsvis_bundle(view)}</div>'
        )
    for stem, df in out.tables.items():
        path = next((f for f in files if Path(f).stem == stem), f"{stem}.csv")
        parts.append(_table_html(df, path))
    if out.notes:
        parts.append("<p class='notes'>" + "<br/>".join(_esc(n) for n in out.notes) + "</p>")
    parts.append(f'<p class="meta">computed in {seconds:.1f} s</p>')
    return "\n".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1100px;
 padding:0 1em;color:#222;line-height:1.45}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
div.table,div.view{overflow-x:auto} table.tbl{border-collapse:collapse;font-size:.82em;margin:.4em 0}
table.tbl td,table.tbl th{padding:2px 7px;border-bottom:1px solid #eee;text-align:right}
table.settings td{padding:1px 10px 1px 0}
figure{margin:1em 0} figure img{max-width:100%} figcaption{font-size:.8em;color:#666}
.cap,.meta,.notes,figcaption{font-size:.8em;color:#666}
.status{font-size:.75em;padding:1px 6px;border-radius:3px;margin-left:.5em;vertical-align:middle}
.computed,.reused{background:#e3f4e6} .skipped{background:#eee} .failed{background:#fbe3e3}
.pending{background:#fff5d6}
pre.err{background:#fbe3e3;padding:.5em;overflow:auto;font-size:.8em}
"""


def html_document(title: str, body: str) -> str:
    """A self-contained page: inline CSS, and circuitsvis' bundle inlined once when ``body`` has a view."""
    bundle = f"<script>{circuitsvis_bundle()}</script>" if "CircuitsVis." in body else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"/>
<meta name="viewport" content="width=device-width, initial-scale=1"/>
<title>{_esc(title)}</title>
<style>{_CSS}</style>
{bundle}
</head><body>
{body}
</body></html>
"""


def _page(settings: ReportSettings, records: list[StageRecord], pending: Sequence[Stage]) -> str:
    from mechgeom import __version__

    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in settings.as_dict().items())
    toc = []
    sections = []
    for r in records:
        toc.append(
            f'<li><a href="#{r.name}">{_esc(r.title)}</a> <span class="status {r.status}">{r.status}</span></li>'
        )
        if r.status == "skipped":
            body = f"<p>not available: {_esc(r.reason)}</p>"
        elif r.status == "failed":
            body = f"<p>this stage failed; rerun the report to retry it.</p><pre class='err'>{_esc(r.reason)}</pre>"
        else:
            body = r.fragment
        sections.append(
            f'<section id="{r.name}"><h2>{_esc(r.title)} <span class="status {r.status}">{r.status}</span></h2>'
            f"{body}</section>"
        )
    for st in pending:
        toc.append(f'<li>{_esc(st.title)} <span class="status pending">pending</span></li>')
    body = f"""<h1>mechgeom report</h1>
<p>{_esc(settings.model)} on {_esc(settings.corpus)}: {settings.n_texts} windows of {settings.seq_len} tokens
(seed {settings.seed}{", quick" if settings.quick else ""}). mechgeom {_esc(__version__)}.
Geometry is measured on the model as loaded, <code>b_O</code> excluded; sink position 0 is the first token the
model sees (SmolLM2: the first text token, no BOS).</p>
<table class="settings">{rows}</table>
<ol class="toc">{"".join(toc)}</ol>
{"".join(sections)}"""
    return html_document(f"mechgeom report: {settings.model} on {settings.corpus}", body)


def _panels_html(view: Any) -> list[tuple[str, str]]:
    """The ``(caption, local_src)`` panels of a :class:`mechgeom.viz.View`."""
    return [(caption, part.local_src) for caption, part in view.panels]


def contributions_html(
    result: Any, path: str | Path, *, heads: Sequence[int] | None = None, batch: int = 0
) -> Path:
    """One self-contained HTML page with a :func:`mechgeom.viz.layer_view` (attention and contribution
    weights of every head, and the whole layer) per analysed layer of a
    :class:`~mechgeom.analyses.contribution.ContributionResult`; circuitsvis' bundle is inlined once.

    ``heads`` shows one :func:`~mechgeom.viz.head_view` per chosen head instead.
    """
    from mechgeom import viz

    parts = [
        f"<h1>Contribution weights: {_esc(result.model_name or 'model')}</h1>",
        f"<p>{result.shape[2]} tokens, text {batch}; basis: {_esc(result.basis)}.</p>",
    ]
    for layer in result.layers:
        view = (
            viz.layer_view(result, layer, batch=batch)
            if heads is None
            else _filter_heads(result, layer, batch, heads)
        )
        parts.append(f"<section><h2>Layer {layer}</h2>")
        for caption, src in _panels_html(view):
            parts.append(
                f"<div class='view'><p class='cap'>{_esc(caption)}</p>{strip_circuitsvis_bundle(src)}</div>"
            )
        parts.append("</section>")
    out = Path(path)
    with atomic_write(out) as f:
        f.write(html_document("mechgeom contribution weights", "\n".join(parts)))
    return out


def _filter_heads(result: Any, layer: int, batch: int, heads: Sequence[int]) -> Any:
    """A :class:`mechgeom.viz.View` with the :func:`~mechgeom.viz.head_view` panels of the chosen heads."""
    from mechgeom import viz

    views = [viz.head_view(result, layer, h, batch=batch) for h in heads]
    return viz.View(f"layer {layer}", [p for v in views for p in v.panels])


# --------------------------------------------------------------------------- stage: contributions


def _contribution_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": s.n_texts,
        "metrics": ["attention", "value_weighted_normalized", "contribution"],
        "batch_size": 4,
    }


def _score_sums(
    a: torch.Tensor, vn: torch.Tensor, c: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-head ``(sum, count)`` pairs over texts and queries ``i >= 1`` of ``[batch, head, q, k]``
    attention ``a``, output-normalised value weights ``vn`` and contribution weights ``c``, so that batches
    add up (see :func:`_score_summary`)."""
    q, k = a.shape[-2:]
    mask = torch.ones(q, k, dtype=torch.bool, device=a.device).tril()  # [q k]: sources j <= i
    valid = mask & ~torch.isnan(c)  # [b h q k]
    a_top = a.masked_fill(~mask, -math.inf).argmax(-1)  # [b h q]
    c_top = c.masked_fill(~valid, -math.inf).argmax(-1)
    row_ok = valid.any(-1)[..., 1:]  # [b h q-1]: rows with a finite contribution (not a zero output norm)
    tv = 0.5 * (c - a).abs().masked_fill(~mask, 0.0).sum(-1)[..., 1:]  # [b h q-1]; NaN rows stay NaN
    dims = (0, 2)

    def nan_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ok = ~torch.isnan(x)
        return torch.where(ok, x, 0.0).sum(dims), ok.sum(dims)

    return {
        "sink_attention": (a[..., 1:, 0].sum(dims), torch.full_like(a[0, :, 0, 0], a.shape[0] * (q - 1))),
        "sink_value_weighted_normalized": nan_pair(vn[..., 1:, 0]),
        "sink_contribution": nan_pair(c[..., 1:, 0]),
        "negative_share": (((c < 0) & valid)[..., 1:, :].sum((0, 2, 3)), valid[..., 1:, :].sum((0, 2, 3))),
        "top1_agreement": (((a_top == c_top)[..., 1:] & row_ok).sum(dims), row_ok.sum(dims)),
        "tv_attention_contribution": nan_pair(tv),
    }


def _finish(sums: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: (s.double() / n.double()).where(n > 0, torch.nan).float() for k, (s, n) in sums.items()}


def _add_sums(
    acc: dict[str, tuple[torch.Tensor, torch.Tensor]] | None,
    new: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if acc is None:
        return {k: (s.double(), n.double()) for k, (s, n) in new.items()}
    return {k: (acc[k][0] + s.double(), acc[k][1] + n.double()) for k, (s, n) in new.items()}


def _score_summary(a: torch.Tensor, vn: torch.Tensor, c: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head means over texts and queries ``i >= 1`` of ``[batch, head, q, k]`` attention ``a``,
    output-normalised value weights ``vn`` and contribution weights ``c``: the share of each on the sink
    (position 0), the share of negative ``c``, how often ``a`` and ``c`` pick the same top source (ties: the
    lower position), and the total-variation distance ``0.5 sum_j |c - a|``. Rows where ``c`` is NaN (zero
    output norm) are left out of the ``c`` statistics."""
    return _finish(_score_sums(a, vn, c))


def _heatmaps(df: pd.DataFrame, cols: Sequence[tuple[str, str]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.4 * len(cols), 3.6))
    axes = fig.subplots(1, len(cols), sharey=True, squeeze=False)[0]
    for ax, (col, title) in zip(axes, cols, strict=True):
        grid = df.pivot(index="layer", columns="head", values=col)
        im = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", cmap="viridis", origin="lower")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head")
        fig.colorbar(im, ax=ax, fraction=0.046)
    axes[0].set_ylabel("layer")
    fig.tight_layout()
    return fig


def _run_contributions(ctx: _Context, p: dict[str, Any]) -> StageOutput:
    from mechgeom import viz
    from mechgeom.analyses.contribution import ContributionCollector, ContributionResult
    from mechgeom.hooks import run_hooks

    model = ctx.model
    tokens = ctx.tokens[: p["n_texts"]]
    metrics = p["metrics"]
    head_sums: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    layer_sums: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    first: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def on_layer(layer: int, m: dict[str, dict[str, torch.Tensor]]) -> None:
        intra, inter = m["intra"], m["inter"]  # [b h q k] and [b q k]
        names = ("attention", "value_weighted_normalized", "contribution")
        head_sums[layer] = _add_sums(head_sums.get(layer), _score_sums(*(intra[k] for k in names)))
        layer_sums[layer] = _add_sums(layer_sums.get(layer), _score_sums(*(inter[k][:, None] for k in names)))
        if layer not in first:  # text 0 (first batch) for the view
            first[layer] = {
                "intra": {k: intra[k][:1].clone() for k in ("attention", "contribution")},
                "inter": {k: inter[k][:1].clone() for k in ("attention", "contribution")},
            }

    col = ContributionCollector(model, None, intra=metrics, inter=metrics, on_layer=on_layer)
    batch = p["batch_size"]
    starts = range(0, tokens.shape[0], batch)
    for start in progress(starts, desc="contributions", enabled=ctx.verbose, total=len(starts)):
        run_hooks(model, tokens[start : start + batch], col.fwd_hooks)
    frames = []
    for layer in sorted(head_sums):
        frame = pd.DataFrame({k: v.numpy() for k, v in _finish(head_sums[layer]).items()})
        frame.insert(0, "head", range(len(frame)))
        frame.insert(0, "layer", layer)
        frames.append(frame)
    heads = pd.concat(frames, ignore_index=True)
    layers = pd.DataFrame(
        [
            {"layer": la, **{k: float(v[0]) for k, v in _finish(layer_sums[la]).items()}}
            for la in sorted(layer_sums)
        ]
    )
    tv = layers["tv_attention_contribution"].to_numpy()
    view_layer = int(layers["layer"].to_numpy()[int(np.nanargmax(tv)) if np.isfinite(tv).any() else 0])
    one = ContributionResult(
        layers=[view_layer],
        tokens=tokens[:1].cpu(),
        intra={k: v[:, None] for k, v in first[view_layer]["intra"].items()},
        inter={k: v[:, None] for k, v in first[view_layer]["inter"].items()},
        str_tokens=[ctx.str_tokens(0)],
        model_name=ctx.settings.model,
    )
    view = viz.layer_view(one, view_layer)
    out = StageOutput(
        tables={"contributions": heads, "contributions_layers": layers},
        figures={
            "contributions_heatmaps": _heatmaps(
                heads,
                [
                    ("sink_attention", "sink attention"),
                    ("sink_contribution", "sink contribution weight"),
                    ("tv_attention_contribution", "TV(attention, contribution)"),
                ],
            )
        },
        views=_panels_html(view),
    )
    out.summary = [
        f"Averaged over {len(heads)} heads and {len(tokens)} texts: the sink (position 0) receives "
        f"{heads.sink_attention.mean():.3f} of the attention but {heads.sink_contribution.mean():.3f} of the "
        f"contribution weight ({heads.sink_value_weighted_normalized.mean():.3f} of the output-normalised "
        "value weight).",
        f"Contribution weights are negative for {heads.negative_share.mean():.1%} of (query, source) pairs; "
        f"attention's top source is the contribution's top source for {heads.top1_agreement.mean():.1%} of "
        "queries.",
        f"Layer {view_layer} differs most from attention (whole-layer total-variation distance "
        f"{np.nanmax(tv):.3f}); its heads for text 0 are shown below.",
    ]
    out.notes = [
        "Queries i >= 1. c[h,i,j] = <o[i,h], alpha vt[j,h]> / |o[i,h]|^2 (SPEC.md §A); "
        "contributions_layers.csv holds the inter-head (whole-layer) versions."
    ]
    return out


# --------------------------------------------------------------------------- stage: faithfulness


def _faithfulness_params(s: ReportSettings) -> dict[str, Any]:
    from mechgeom.analyses.faithfulness import FAITHFULNESS_METRICS, MODES

    rates = [0.0, 0.3, 0.6] if s.quick else [0.0, 0.2, 0.4, 0.6, 0.8]
    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 4),
        "metrics": list(FAITHFULNESS_METRICS),
        "modes": list(MODES),
        "rates": rates,
        "scope": "intra",
        "layers": "all",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def faithfulness_order(frame: pd.DataFrame, claimed: Sequence[str]) -> list[str]:
    """One sentence per mode: the metrics by mean ΔPPL over the rates > 0 (most faithful first) and whether
    paper A's order ``claimed[0] < claimed[1] < ...`` (least to most faithful) holds, holds only up to ties
    (equal means: identical rankings, e.g. intra-head value-weighted and output-normalised), or fails."""
    area = frame[frame["rate"] > 0].groupby(["mode", "metric"])["delta_ppl"].mean()
    lines = []
    for mode, higher in (("comprehensiveness", True), ("sufficiency", False)):
        if mode not in area.index.get_level_values(0):
            continue
        by_metric = area[mode]
        ranked = by_metric.sort_values(ascending=not higher)
        ranking = " > ".join(f"{m} ({v:+.3g})" for m, v in ranked.items())
        vals = [float(by_metric.get(m, np.nan)) for m in claimed]
        better = [(b - a) if higher else (a - b) for a, b in itertools.pairwise(vals)]  # > 0: claimed order
        tied = [f"{x} = {y}" for (x, y), d in zip(itertools.pairwise(claimed), better, strict=True) if d == 0]
        if all(d > 0 for d in better):
            verdict = "holds"
        elif all(d >= 0 for d in better):
            verdict = f"holds up to ties ({', '.join(tied)}: identical rankings)"
        else:
            verdict = "does not hold"
        lines.append(
            f"{mode} (mean ΔPPL over rates > 0; {'higher' if higher else 'lower'} = more faithful), most "
            f"faithful first: {ranking}. Paper A's order {' < '.join(claimed)}: {verdict} here."
        )
    return lines


def _run_faithfulness(ctx: _Context, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.faithfulness import perplexity_curves
    from mechgeom.viz import plot_curves

    partial = ctx.partial_path("faithfulness", ".csv")
    frame = perplexity_curves(
        ctx.model,
        ctx.tokens[: p["n_texts"]],
        metrics=p["metrics"],
        rates=p["rates"],
        modes=p["modes"],
        scope=p["scope"],
        seed=p["seed"],
        n_boot=p["n_boot"],
        out=partial,
        verbose=ctx.verbose,
    )
    fig = plot_curves(frame, title=f"{ctx.settings.model}: all layers masked at once")
    summary = faithfulness_order(frame, [m for m in p["metrics"] if m != "random"])
    clean = float(frame["clean_ppl"].iloc[0])
    summary.append(
        f"Clean perplexity {clean:.2f} on {p['n_texts']} windows; rates {p['rates']}; bands are 95% bootstrap "
        "intervals over texts."
    )
    for extra in Path(partial).parent.glob(f"{Path(partial).stem}*"):
        extra.unlink()
    return StageOutput(tables={"faithfulness": frame}, figures={"faithfulness_curves": fig}, summary=summary)


# --------------------------------------------------------------------------- stage: sinks


def _sinks_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 2 if s.quick else 8),
        "sink_positions": [0],
        "convexity_heads": 2 if s.quick else 3,
        "s_values": [0.0, 0.25, 0.5, 0.75, 1.0] if s.quick else [round(0.1 * k, 1) for k in range(11)],
        "ablation_mode": "zero",
        "seed": s.seed,
        "n_boot": 200 if s.quick else 1000,
    }


def _run_sinks(ctx: _Context, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.sinks import convexity_by_intervention, sink_ablation, sink_statistics
    from mechgeom.viz import (
        plot_cone_shift,
        plot_convexity_curves,
        plot_rate_vs_ratio,
        plot_sink_rate_vs_s_star,
    )

    model, tokens = ctx.model, ctx.tokens[: p["n_texts"]]
    stats = sink_statistics(model, tokens, sink_positions=p["sink_positions"], verbose=ctx.verbose)
    table = stats.to_frame()
    heads_df = table.drop_duplicates(["layer", "head"])
    top = heads_df[heads_df["layer"] > 0].nlargest(p["convexity_heads"], "sink_rate")
    chosen = [(int(a), int(b)) for a, b in zip(top["layer"], top["head"], strict=True)]
    measured: dict[tuple[int, int], tuple[Sequence[float], torch.Tensor]] = {}
    rows = []
    s_values = p["s_values"]
    closed = stats.norm_curve(torch.tensor(s_values, dtype=torch.float64))  # [n layer head q grid]
    for layer, head in progress(chosen, desc="convexity", enabled=ctx.verbose):
        norms = convexity_by_intervention(
            model, tokens, s_values, layer=layer, heads=[head], sink_positions=p["sink_positions"]
        )  # [grid batch head q]
        li = stats.layer_index(layer)
        measured[(layer, head)] = (s_values, norms[:, 0, head])
        for g, s in enumerate(s_values):
            for b in range(tokens.shape[0]):
                m_row, c_row = norms[g, b, head], closed[b, li, head, :, g]
                for q in torch.nonzero(torch.isfinite(m_row)).flatten().tolist():
                    rows.append(
                        {"layer": layer, "head": head, "s": s, "text": b, "query": q,
                         "norm_measured": float(m_row[q]), "norm_closed_form": float(c_row[q])}
                    )  # fmt: skip
    conv = pd.DataFrame(rows)
    rel_err = (conv["norm_measured"] - conv["norm_closed_form"]).abs() / conv["norm_closed_form"].abs().clip(
        lower=1e-12
    )
    abl = sink_ablation(model, tokens, mode=p["ablation_mode"], sink_positions=p["sink_positions"], seed=p["seed"],
                        verbose=ctx.verbose)  # fmt: skip
    summ = abl.summary(n_boot=p["n_boot"], seed=p["seed"])
    ratio = heads_df["norm_ratio_vt"]
    out = StageOutput(
        tables={"sinks": table, "sinks_convexity": conv, "sinks_ablation": abl.to_frame()},
        figures={
            "sinks_rate_vs_ratio": plot_rate_vs_ratio(stats),
            "sinks_rate_vs_s_star": plot_sink_rate_vs_s_star(stats),
            "sinks_convexity": plot_convexity_curves(stats, chosen, measured=measured),
            "sinks_cone_shift": plot_cone_shift(abl),
        },
    )
    out.summary = [
        f"Mean sink rate {heads_df.sink_rate.mean():.3f} over {len(heads_df)} heads; sink norm ratio "
        f"(projected) median {ratio.median():.3f} (paper B: 3–10× smaller, i.e. 0.1–0.33); "
        f"{(ratio < 1 / 3).mean():.1%} of heads below 1/3.",
        f"Anti-alignment: mean cos(vt_sink, m) = {heads_df.cos_sink_mean.mean():.3f}; "
        f"s* lies inside (0, 1) for {float(stats.interior_share(pooled=True)):.1%} of (head, query) pairs.",
        f"Convexity by intervention on {', '.join(f'L{a}H{b}' for a, b in chosen)} matches the closed form: "
        f"max relative error {rel_err.max():.2e} over {len(conv)} points.",
        f"Sink-value ablation ({p['ablation_mode']}, every layer and head): ΔPPL {summ['dppl_sink']:+.3f} "
        f"(ΔNLL 95% CI [{summ['dnll_sink_lo']:+.3f}, {summ['dnll_sink_hi']:+.3f}]) vs random-position control "
        f"ΔPPL {summ['dppl_control']:+.3f}; mean relative change of the head-output norm "
        f"{summ['d_out_norm_rel_sink']:+.1%} (control {summ['d_out_norm_rel_control']:+.1%}), "
        f"Δcos(o, mu) {summ['d_cone_cos_sink']:+.3f} (control {summ['d_cone_cos_control']:+.3f}).",
    ]
    return out


# --------------------------------------------------------------------------- stage: selection


def _selection_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 1 if s.quick else 4),
        "layers": "spread4" if s.quick else "all",
        "ns": [1, 2, 4, 8] if s.quick else [1, 2, 4, 8, 16, 32],
        "n_random": 2 if s.quick else 4,
        "query_stride": 4,
        "seed": s.seed,
    }


def _spread_layers(n_layers: int, k: int) -> list[int]:
    return sorted({round(i * (n_layers - 1) / max(k - 1, 1)) for i in range(k)})


def _selection_figure(df: pd.DataFrame, params: pd.DataFrame) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    means = df.groupby("N")[["f_top", "f_random", "f_nosink", "bound", "bound_ideal"]].mean()
    for col, label, style in (
        ("f_top", "top-N", "-o"),
        ("f_random", "random N-subsets", "--o"),
        ("f_nosink", "top-N, sink excluded", "-s"),
        ("bound", "sink-aware bound (fitted)", ":"),
    ):
        ax1.plot(means.index, means[col], style, ms=3, label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("N")
    ax1.set_ylabel("mean extreme F-score")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.scatter(df["bound_ideal"], df["f_top"], s=6, c=np.log2(df["N"]), cmap="viridis")
    ax2.plot([0, 1], [0, 1], color="0.5", lw=0.8, ls="--")
    ax2.set_xlabel("constant-norm prediction")
    ax2.set_ylabel("measured F_N (per head)")
    ax2.set_title("predicted vs measured", fontsize=9)
    fig.tight_layout()
    return fig


def _run_selection(ctx: _Context, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.selection import token_selection

    model = ctx.model
    n_layers = int(model.cfg.n_layers)
    layers = _spread_layers(n_layers, 4) if p["layers"] == "spread4" else list(range(n_layers))
    res = token_selection(
        model, ctx.tokens[: p["n_texts"]], layers=layers, ns=p["ns"], n_random=p["n_random"],
        query_stride=p["query_stride"], seed=p["seed"], verbose=False,
    )  # fmt: skip
    df = res.to_frame()
    params = res.params_frame()
    small = df[df["N"] <= 4]
    sink_rows = df.dropna(subset=["f_top_sink_in", "f_nosink_sink_in"])
    out = StageOutput(
        tables={"selection": df, "selection_params": params},
        figures={"selection_f_scores": _selection_figure(df, params)},
    )
    out.summary = [
        f"{len(layers)} layers × {df['head'].nunique()} heads, N in {p['ns']}, every {p['query_stride']}th query "
        f"of {p['n_texts']} window(s).",
        f"Top-N sets vs random N-subsets (N <= 4): mean F {small.f_top.mean():.3f} vs {small.f_random.mean():.3f} "
        f"(gap {small.f_gap.mean():+.3f}; paper B: top-N more separable at small N).",
        f"With the sink in I_N: F {sink_rows.f_top_sink_in.mean():.3f} with it vs {sink_rows.f_nosink_sink_in.mean():.3f} "
        "without position 0 (paper B: including it often halves F_N).",
        f"Inversion certificates violated {int(df.cert_violations.sum())} times, the fitted sink-aware bound "
        f"{int(df.bound_violations.sum())} times (both must be 0); the constant-norm regime holds for "
        f"{params.regime.mean():.1%} of heads.",
    ]
    return out


# --------------------------------------------------------------------------- stage: taxonomy


def _taxonomy_params(s: ReportSettings) -> dict[str, Any]:
    from mechgeom.data import CORPORA

    other = next(c for c in CORPORA if c != s.corpus and c != "gsm8k") if s.corpus in CORPORA else None
    return {"n_texts": s.n_texts, "second_corpus": other, "sink_positions": [0]}


def _run_taxonomy(ctx: _Context, p: dict[str, Any]) -> StageOutput:
    from mechgeom.analyses.taxonomy import classify_heads, label_agreement, regime_summary
    from mechgeom.data import load_corpus
    from mechgeom.viz import plot_regime_grid

    model, s = ctx.model, ctx.settings
    res = classify_heads(
        model,
        ctx.tokens[: p["n_texts"]],
        sink_positions=p["sink_positions"],
        corpus=s.corpus,
        verbose=ctx.verbose,
    )
    table = res.to_frame()
    summary_df = regime_summary(table)
    shares = dict(zip(summary_df["label"], summary_df["share"], strict=True))
    tables = {"taxonomy": table, "taxonomy_regimes": summary_df}
    lines = [
        "Heads by regime: "
        + ", ".join(f"{lab} {shares.get(lab, 0.0):.1%}" for lab in ("Retriever", "Mixer", "Reset"))
        + " (paper B: Retrievers are 5.8–17.2% of heads; Mixer vs Reset depends on the model family).",
    ]
    if {"cos_out_sink", "cos_out_cur"} <= set(summary_df.columns):
        al = summary_df.set_index("label")
        mix_sink = float(al["cos_out_sink"].to_dict().get("Mixer", np.nan))
        ret_cur = float(al["cos_out_cur"].to_dict().get("Retriever", np.nan))
        lines.append(
            f"Alignment: Mixers' outputs vs the sink value cos {mix_sink:.3f}; "
            f"Retrievers' outputs vs the current token's value cos {ret_cur:.3f} "
            "(NaN where a regime has no head)."
        )
    if p["second_corpus"] is not None:
        other_tokens = load_corpus(
            p["second_corpus"], model, n_texts=s.n_texts, seq_len=s.seq_len, seed=s.seed
        )
        other = classify_heads(
            model,
            other_tokens,
            sink_positions=p["sink_positions"],
            corpus=p["second_corpus"],
            verbose=ctx.verbose,
        ).to_frame()
        agree = label_agreement({s.corpus: table, p["second_corpus"]: other})
        tables["taxonomy_agreement"] = agree.pairwise
        lines.append(f"Label agreement {s.corpus} vs {p['second_corpus']}: {agree.all_agree:.1%} of heads.")
    fig = plot_regime_grid(table, title=f"{s.model} on {s.corpus}")
    return StageOutput(tables=tables, figures={"taxonomy_regimes": fig}, summary=lines)


# --------------------------------------------------------------------------- stage: pruning


def _pruning_params(s: ReportSettings) -> dict[str, Any]:
    return {
        "n_texts": min(s.n_texts, 2),
        "levels": [1.0, 0.7, 0.4, 0.1] if s.quick else [round(1.0 - 0.1 * k, 1) for k in range(10)],
        "single_head": not s.quick,
        "mode": "zero",
        "seed": s.seed,
        "critical_k": 5.0,
    }


def _run_pruning(ctx: _Context, p: dict[str, Any]) -> StageOutput:

    from mechgeom.analyses.pruning import head_orders, head_stats, retention_curves, single_head_sweep
    from mechgeom.analyses.taxonomy import classify_heads
    from mechgeom.viz import plot_retention

    model, tokens = ctx.model, ctx.tokens[: p["n_texts"]]
    stats = head_stats(model, tokens, verbose=ctx.verbose)
    taxonomy = (
        classify_heads(model, tokens).to_frame()
        if _module_missing("mechgeom.analyses.taxonomy") is None
        else None
    )
    sweep = None
    tables: dict[str, pd.DataFrame] = {}
    lines = []
    if p["single_head"]:
        sweep = single_head_sweep(
            model, tokens, mode=p["mode"], checkpoint=ctx.partial_path("pruning_single_head", ".csv"),
            verbose=ctx.verbose,
        )  # fmt: skip
        board = sweep.to_frame(k=p["critical_k"])
        tables["pruning_single_head"] = board
        crit = board[board["critical"]]
        lines.append(
            f"Single-head ablation: median ΔPPL {board.delta_ppl.median():+.3f}; the most harmful head is "
            f"L{int(board['layer'].iloc[0])}H{int(board['head'].iloc[0])} (ΔPPL {board.delta_ppl.iloc[0]:+.3f}); "
            f"{len(crit)} critical head(s) (ΔPPL > median + {p['critical_k']:g}·MAD)"
            + (": " + ", ".join(f"L{int(a)}H{int(b)}" for a, b in zip(crit["layer"], crit["head"], strict=True)) if len(crit) else "")
            + "."
        )  # fmt: skip
    else:
        lines.append("Quick run: no single-head ablation sweep (the single_head order is left out).")
    orders = head_orders(model, stats, taxonomy=taxonomy, sweep=sweep, seed=p["seed"])
    curves = retention_curves(
        model, orders, {ctx.settings.corpus: tokens}, levels=p["levels"], mode=p["mode"],
        checkpoint=ctx.partial_path("pruning_curves", ".csv"), verbose=ctx.verbose,
    )  # fmt: skip
    frame = curves.to_frame()
    tables = {"pruning": frame, **tables}
    summ = curves.summary().sort_values("mean_delta_ppl")
    lines.insert(
        0,
        "Mean ΔPPL over retention levels below 100%, least harmful order first: "
        + ", ".join(f"{o} {v:+.3g}" for o, v in zip(summ["order"], summ["mean_delta_ppl"], strict=True))
        + f" ({p['n_texts']} windows, {p['mode']} ablation of hook_z).",
    )
    png = plot_retention(frame, title=ctx.settings.model)
    for name in ("pruning_single_head", "pruning_curves"):
        ctx.partial_path(name, ".csv").unlink(missing_ok=True)
    return StageOutput(tables=tables, figures={"pruning_retention": png}, summary=lines)


# --------------------------------------------------------------------------- stage registry


STAGES: tuple[Stage, ...] = (
    Stage(
        "contributions",
        "Contribution weights vs attention",
        "mechgeom.viz",
        _contribution_params,
        _run_contributions,
        "How much of each head's output each source token carries (paper A), beside the raw attention.",
    ),
    Stage(
        "faithfulness",
        "Faithfulness curves",
        "mechgeom.analyses.faithfulness",
        _faithfulness_params,
        _run_faithfulness,
        "Remove each query's top- (comprehensiveness) or bottom-ranked (sufficiency) sources by each metric "
        "on hook_pattern, without renormalising, at every layer at once, and measure ΔPPL (paper A).",
    ),
    Stage(
        "sinks",
        "Sinks, convexity and sink-norm ablation",
        "mechgeom.analyses.sinks",
        _sinks_params,
        _run_sinks,
        "Sink rate and value norms, anti-alignment with the non-sink mean, the convex norm curve ‖o(s)‖ "
        "(closed form and intervention), and zeroing the sink's value vs a random position (papers A and B).",
    ),
    Stage(
        "selection",
        "Token-selection geometry",
        "mechgeom.analyses.selection",
        _selection_params,
        _run_selection,
        "Extreme F-scores of top-N source sets vs random sets and without the sink, the inversion "
        "certificates and the sink-aware lower bound (paper B).",
    ),
    Stage(
        "taxonomy",
        "Head taxonomy",
        "mechgeom.analyses.taxonomy",
        _taxonomy_params,
        _run_taxonomy,
        "Parameter-free source-winner labels: Retriever (current token wins), Mixer (sink wins), "
        "Reset (otherwise) (paper B).",
    ),
    Stage(
        "pruning",
        "Head pruning",
        "mechgeom.analyses.pruning",
        _pruning_params,
        _run_pruning,
        "Perplexity as heads are removed (zeroing hook_z) in taxonomy, weight-magnitude, entropy, random "
        "and single-head-ablation orders (paper B).",
    ),
)


# --------------------------------------------------------------------------- driver


def _json_roundtrip(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True))


def _module_missing(module: str) -> str | None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"the module {module} is not part of this mechgeom installation"


def _load_marker(
    out_dir: Path, stage: Stage, settings: dict[str, Any], params: dict[str, Any]
) -> StageRecord | None:
    marker = out_dir / "stages" / f"{stage.name}.json"
    fragment = out_dir / "stages" / f"{stage.name}.html"
    if not marker.is_file():
        return None
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        logger.warning("%s: unreadable marker %s; recomputing", stage.name, marker)
        return None
    if (
        meta.get("version") != _MARKER_VERSION
        or meta.get("settings") != settings
        or meta.get("params") != params
    ):
        logger.info("%s: settings differ from the previous run in %s; recomputing", stage.name, out_dir)
        return None
    files = [str(f) for f in meta.get("files", [])]
    missing = [f for f in files if not (out_dir / f).is_file()]
    if missing or not fragment.is_file():
        logger.info("%s: files of the previous run are missing (%s); recomputing", stage.name, missing[:3])
        return None
    return StageRecord(
        stage.name,
        stage.title,
        "reused",
        float(meta.get("seconds", 0.0)),
        files,
        fragment.read_text(encoding="utf-8"),
    )


def _save_stage(
    out_dir: Path,
    stage: Stage,
    out: StageOutput,
    settings: dict[str, Any],
    params: dict[str, Any],
    seconds: float,
) -> StageRecord:
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
    fragment = _render_fragment(stage, out, files, seconds)
    with atomic_write(out_dir / "stages" / f"{stage.name}.html") as f:
        f.write(fragment)
    meta = {
        "version": _MARKER_VERSION,
        "stage": stage.name,
        "settings": settings,
        "params": params,
        "files": files,
        "seconds": round(seconds, 2),
    }
    with atomic_write(out_dir / "stages" / f"{stage.name}.json") as f:  # written last: the "done" flag
        json.dump(meta, f, indent=2, sort_keys=True)
    return StageRecord(stage.name, stage.title, "computed", seconds, files, fragment)


def _write_page(
    out_dir: Path, settings: ReportSettings, records: list[StageRecord], pending: Sequence[Stage]
) -> Path:
    path = out_dir / "report.html"
    with atomic_write(path) as f:
        f.write(_page(settings, records, pending))
    return path


def _model_label(model: Any) -> str:
    if isinstance(model, str):
        return model
    return str(getattr(model.cfg, "model_name", type(model).__name__))


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
        stages: names of the stages to run (default: all of :data:`STAGES`).

    Raises:
        NotADirectoryError: ``out_dir`` is an existing file.
        ValueError: unknown stage names, an unknown corpus or non-positive sizes.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is an existing file; give a directory for the report")
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
    selected = list(STAGES) if stages is None else [s for s in STAGES if s.name in set(stages)]
    if stages is not None:
        unknown = sorted(set(stages) - {s.name for s in STAGES})
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; choose from {[s.name for s in STAGES]}")
    settings = ReportSettings(_model_label(model), corpus, n_texts, seq_len, seed, quick)
    key = _json_roundtrip(settings.as_dict())
    ctx = _Context(
        settings,
        out,
        model=None if isinstance(model, str) else model,
        tokens=tokens,
        device=device,
        verbose=verbose,
    )
    out.mkdir(parents=True, exist_ok=True)
    records: list[StageRecord] = []
    t_all = time.perf_counter()
    for k, stage in enumerate(selected, 1):
        tag = f"[{k}/{len(selected)}] {stage.name}"
        missing = _module_missing(stage.module)
        if missing is not None:
            logger.info("%s: not available (%s)", tag, missing)
            records.append(StageRecord(stage.name, stage.title, "skipped", reason=missing))
            continue
        params = _json_roundtrip(stage.params(settings))
        rec = _load_marker(out, stage, key, params)
        if rec is not None:
            logger.info("%s: reused from %s", tag, out / "stages" / f"{stage.name}.json")
            records.append(rec)
            continue
        logger.info("%s: computing ...", tag)
        ctx.stage_key = hashlib.sha256(json.dumps([key, params], sort_keys=True).encode()).hexdigest()[:12]
        _ = ctx.tokens  # loading errors (model, corpus) stop the report rather than fail every stage
        t0 = time.perf_counter()
        try:
            result = stage.run(ctx, params)
            rec = _save_stage(out, stage, result, key, params, time.perf_counter() - t0)
        except Exception as exc:
            logger.error("%s: failed: %s", tag, exc)
            logger.debug("%s", traceback.format_exc())
            rec = StageRecord(
                stage.name,
                stage.title,
                "failed",
                time.perf_counter() - t0,
                reason=f"{type(exc).__name__}: {exc}",
            )
        else:
            logger.info("%s: done in %.1f s", tag, rec.seconds)
            with contextlib.suppress(OSError):  # only if the stage left no checkpoint behind
                (out / "partial").rmdir()
        records.append(rec)
        _write_page(out, settings, records, selected[k:])
    path = _write_page(out, settings, records, [])
    logger.info("report written to %s (%.1f s)", path, time.perf_counter() - t_all)
    return ReportResult(out, path, settings, records)
