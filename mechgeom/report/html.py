"""The report's HTML: offline pages (inline CSS, circuitsvis' bundle once, PNG figures as base64), tables
and the sections of each stage."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mechgeom._io import atomic_write
from mechgeom.report.base import ReportSettings, Stage, StageOutput, StageRecord

__all__ = [
    "contributions_html",
    "figure_png",
    "html_document",
    "page_html",
    "panels_html",
    "render_fragment",
]


def figure_png(fig: Any, *, dpi: int = 80) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed afterwards)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    import sys

    if "matplotlib.pyplot" in sys.modules:  # a pyplot figure would otherwise stay open
        sys.modules["matplotlib.pyplot"].close(fig)
    return buf.getvalue()


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _table_html(df: pd.DataFrame, name: str, max_rows: int = 12) -> str:
    shown = df.head(max_rows).dropna(axis=1, how="all")  # the file keeps every column
    body = shown.to_html(
        index=False, border=0, classes="tbl", float_format=lambda x: f"{x:.4g}", na_rep="nan"
    )
    more = f"first {len(shown)} of {len(df)} rows; " if len(df) > max_rows else ""
    return f'<div class="table"><p class="cap">{more}full table: <code>{_esc(name)}</code></p>{body}</div>'


def render_fragment(stage: Stage, out: StageOutput, files: list[str], seconds: float) -> str:
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
        parts.append(_view_html(caption, view))
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


def _view_html(caption: str, src: str) -> str:
    """A captioned circuitsvis view, without its copy of the bundle (:func:`html_document` adds it once)."""
    from mechgeom.viz.views import strip_circuitsvis_bundle

    return f'<div class="view"><p class="cap">{_esc(caption)}</p>{strip_circuitsvis_bundle(src)}</div>'


def html_document(title: str, body: str) -> str:
    """A self-contained page: inline CSS, and circuitsvis' bundle inlined once when ``body`` has a view
    (:func:`mechgeom.viz.views.circuitsvis_script`, as :func:`mechgeom.viz.save_html` writes it)."""
    from mechgeom.viz.views import circuitsvis_script

    bundle = circuitsvis_script(body)
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


def page_html(settings: ReportSettings, records: list[StageRecord], pending: Sequence[Stage]) -> str:
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


def panels_html(view: Any) -> list[tuple[str, str]]:
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
        parts.extend(_view_html(caption, src) for caption, src in panels_html(view))
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
