"""circuitsvis views of contribution weights (presentation only: nothing here computes an analysis).

- :func:`head_view` / :func:`layer_view`: ``circuitsvis.attention.attention_heads`` with the raw attention
  pattern and the contribution weights of a head (or of every head of a layer, plus the inter-head
  weights) shown side by side as if they were attention heads.
- :func:`token_view`: ``circuitsvis.tokens.colored_tokens``, the signed weight of each source token for one
  query.
- :func:`save_html`: one self-contained offline HTML file (circuitsvis' bundled JavaScript inlined once, never
  the unpkg CDN), written atomically. :func:`strip_circuitsvis_bundle` and :func:`circuitsvis_script` are
  the two steps it shares with the report's page (:func:`mechgeom.report.html.html_document`).

**Signed display.** Contribution weights can be negative and can exceed 1. Every view uses a diverging
scale centred on 0: white at 0, :data:`POSITIVE_COLOR` (blue) for positive and :data:`NEGATIVE_COLOR` (red)
for negative weights, saturating at ``±scale`` (default 1: a source that carries the whole output). Raw
attention shares that scale, so an attention weight and a contribution weight of the same size get the same
colour. The token view scales to ``max |w|`` of the query's sources so that small negative weights stay
visible. NaN weights (a zero output norm, see :mod:`mechgeom.analyses.contribution.weights`) are drawn as 0 (white) and the
caption says how many there were. Entries above the diagonal are masked (grey) as circuitsvis does for
causal attention (not for an encoder's result, whose queries see every key).
"""

from __future__ import annotations

import functools
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mechgeom._io import atomic_write
from mechgeom.analyses.contribution.weights import ContributionResult
from mechgeom.hooks import check_index, check_text_position
from mechgeom.typing import Float, Tensor

__all__ = [
    "NEGATIVE_COLOR",
    "POSITIVE_COLOR",
    "View",
    "head_view",
    "layer_view",
    "save_html",
    "token_view",
]

#: Colour of negative weights (ColorBrewer RdBu red).
NEGATIVE_COLOR = "#b2182b"
#: Colour of positive weights (ColorBrewer RdBu blue).
POSITIVE_COLOR = "#2166ac"

_LABELS = {
    "attention": "attention",
    "value_weighted": "value-weighted",
    "value_weighted_normalized": "value-weighted (normalised)",
    "contribution": "contribution",
    "head_share": "head share",
    "factor_norm_ratio": "norm ratio",
    "factor_cos": "cosine",
}


class _Rendered(Protocol):
    """What circuitsvis returns (``RenderedHTML``): the same view with inlined JS or with a CDN import."""

    local_src: str
    cdn_src: str


@dataclass
class View:
    """A titled list of circuitsvis panels, each with a caption. Shows itself in Jupyter (offline JS)."""

    title: str
    panels: list[tuple[str, _Rendered]] = field(default_factory=list)

    def _repr_html_(self) -> str:
        # self-contained per view: each panel keeps its own copy of the bundle (local_src)
        return "".join(_panel_html(caption, part.local_src) for caption, part in self.panels)


def _panel_html(caption: str, src: str) -> str:
    return f'<div class="mechgeom-panel"><p>{html.escape(caption)}</p>\n{src}\n</div>\n'


# --------------------------------------------------------------------------- argument checks


def _intra(
    result: ContributionResult, metric: str
) -> Float[Tensor, "batch layer head_index query_pos key_pos"]:
    if metric not in result.intra:
        raise KeyError(f"intra-head metric {metric!r} is not in the result; it has {sorted(result.intra)}")
    return result.intra[metric]


def _inter(result: ContributionResult, metric: str) -> Float[Tensor, "batch layer query_pos key_pos"]:
    if metric not in result.inter:
        raise KeyError(f"inter-head metric {metric!r} is not in the result; it has {sorted(result.inter)}")
    return result.inter[metric]


def _tokens(result: ContributionResult, batch: int) -> list[str]:
    if result.str_tokens is not None:
        toks = list(result.str_tokens[batch])
    elif result.tokens is not None:
        toks = [f"<{int(t)}>" for t in result.tokens[batch]]
    else:  # built from a cache without tokens: positions only
        toks = [f"[{i}]" for i in range(result.shape[2])]
    # a token must not close circuitsvis' inline <script> element
    return [t.replace("</", "<\u200b/") for t in toks]


def _every_query(result: ContributionResult, what: str) -> None:
    if result.top_k is not None:
        raise ValueError(
            f"{what} draws every query against every key, but this result keeps the top_k={result.top_k} largest "
            "sources of each query only: use token_view(result, layer, query) for one query, or compute without "
            "top_k="
        )
    if result.query_index is not None:
        raise ValueError(
            f"{what} draws every query against every key, but this result holds some queries only (queries=): "
            "use token_view(result, layer, query) for one of them, or compute without queries="
        )


def _display(t: Tensor) -> tuple[Tensor, int]:
    """NaN -> 0 for display, and how many NaNs there were."""
    t = t.detach().float().cpu()
    n_nan = int(t.isnan().sum())
    return torch.nan_to_num(t, nan=0.0), n_nan


def _nan_note(n_nan: int) -> str:
    return f" {n_nan} NaN weights (zero output norm) drawn as 0." if n_nan else ""


def _scale_note(scale: float, causal: bool = True) -> str:
    grey = (
        "grey cells are future tokens (key > query)."
        if causal
        else "every query sees every key (an encoder)."
    )
    return f"Diverging scale: blue > 0, red < 0, white = 0, saturating at ±{scale:g}; " + grey


# --------------------------------------------------------------------------- views


def _attention_heads(
    panels: list[Tensor], names: list[str], tokens: list[str], scale: float, causal: bool = True
) -> _Rendered:
    from circuitsvis.attention import attention_heads

    return attention_heads(
        attention=torch.stack(panels),  # [panel, query, key]
        tokens=tokens,
        attention_head_names=names,
        max_value=scale,
        min_value=-scale,
        negative_color=NEGATIVE_COLOR,
        positive_color=POSITIVE_COLOR,
        mask_upper_tri=causal,  # an encoder's queries see every key
    )


def head_view(
    result: ContributionResult,
    layer: int,
    head: int,
    *,
    batch: int = 0,
    metrics: Sequence[str] = ("attention", "contribution"),
    scale: float = 1.0,
) -> View:
    """One head's ``metrics`` (default: raw attention and contribution weights) side by side.

    Raises ``IndexError`` for a layer that was not analysed or a head/batch out of range, ``KeyError`` for a
    metric the result does not hold, ``ValueError`` for a result of some queries only (``queries=``).
    Padding is not drawn: the panels are the text's real tokens.
    """
    _every_query(result, "head_view")
    li = result.layer_index(layer)
    n_batch, _, n_heads = _intra(result, metrics[0]).shape[:3]
    batch = check_index(batch, n_batch, "batch")
    head = check_index(head, n_heads, "head")
    panels, n_nan = [], 0
    for m in metrics:
        t, n = _display(_intra(result, m)[batch, li, head])
        panels.append(t)
        n_nan += n
    names = [f"{_LABELS.get(m, m)} L{layer}H{head}" for m in metrics]
    what = f"Layer {layer}, head {head}: {', '.join(names)}. "
    return _panels_view(result, batch, panels, names, scale, n_nan, f"L{layer}H{head}", what)


def layer_view(
    result: ContributionResult,
    layer: int,
    *,
    batch: int = 0,
    metrics: Sequence[str] = ("attention", "contribution"),
    scale: float = 1.0,
) -> View:
    """Every head of ``layer``: for each metric, one panel per head and then the inter-head (whole-layer)
    panel (mean attention, layer contribution weights), where the result holds it. Padding is not drawn;
    a result of some queries only (``queries=``) raises ``ValueError``."""
    _every_query(result, "layer_view")
    li = result.layer_index(layer)
    n_batch, _, n_heads = _intra(result, metrics[0]).shape[:3]
    batch = check_index(batch, n_batch, "batch")
    panels, names, n_nan = [], [], 0
    for m in metrics:
        for h in range(n_heads):
            t, n = _display(_intra(result, m)[batch, li, h])
            panels.append(t)
            names.append(f"{_LABELS.get(m, m)} H{h}")
            n_nan += n
        if m in result.inter:
            t, n = _display(result.inter[m][batch, li])
            panels.append(t)
            names.append(f"{_LABELS.get(m, m)} layer")
            n_nan += n
    what = f"Layer {layer}, {n_heads} heads and the whole layer. "
    return _panels_view(result, batch, panels, names, scale, n_nan, f"layer {layer}", what)


def _panels_view(
    result: ContributionResult,
    batch: int,
    panels: list[Any],
    names: list[str],
    scale: float,
    n_nan: int,
    title: str,
    what: str,
) -> View:
    """One circuitsvis attention-heads view of ``panels`` (named ``names``) over text ``batch``'s real tokens
    (padding cut out), captioned with ``what``, the colour scale and the NaN count."""
    real = result.real()[batch]
    if not bool(real.all()):
        panels = [t[real][:, real] for t in panels]
    tokens = [t for t, r in zip(_tokens(result, batch), real.tolist(), strict=True) if r]
    view = _attention_heads(panels, names, tokens, scale, result.causal)
    caption = what + _scale_note(scale, result.causal) + _nan_note(n_nan)
    return View(f"{result.model_name or 'model'} {title}", [(caption, view)])


def token_view(
    result: ContributionResult,
    layer: int,
    query: int,
    *,
    head: int | None = None,
    batch: int = 0,
    metric: str = "contribution",
) -> View:
    """The signed weight of each source ``j <= query`` for ``query`` (one head, or the whole layer when
    ``head`` is None), as ``colored_tokens`` on a symmetric diverging scale ``±max |w|``.

    ``query`` is a position inside text ``batch`` (padding is not counted), negative from its end: ``-1`` is
    the text's last real token. Only real tokens are drawn. A result computed with ``queries=`` has the kept
    queries only; another one raises ``IndexError`` naming them. A ``top_k`` result draws its kept sources and 0
    at the others (the caption says so)."""
    from circuitsvis.tokens import colored_tokens

    result.layer_index(layer)  # IndexError naming the analysed layers, before anything else
    n_batch, _, _ = result.shape
    batch = check_index(batch, n_batch, "batch")
    real = result.real()[batch]
    keys = real.nonzero().flatten()  # padded positions of the text's tokens
    n = len(keys)
    query = check_text_position(query, n, batch)
    padded = int(keys[query])
    rows = result.rows()[batch]
    found = (rows == padded).nonzero().flatten()
    if len(found) == 0:
        kept = [int(p) - int(keys[0]) for p in rows[rows >= 0]]
        raise IndexError(
            f"query {query} was not computed (queries=); the result holds text {batch}'s queries {kept}"
        )
    r = int(found[0])
    keys = keys[keys <= padded] if result.causal else keys[: query + 1]
    if head is None:
        _inter(result, metric)
        where = f"layer {layer} (all heads)"
    else:
        head = check_index(head, _intra(result, metric).shape[2], "head")
        where = f"layer {layer}, head {head}"
    full_row = result.key_row(metric, batch, layer, r, head=head)
    row = full_row[keys.to(full_row.device)]
    values, n_nan = _display(row)
    top = float(values.abs().max()) or 1.0
    every = _tokens(result, batch)
    tokens = [every[int(k)] for k in keys]
    view = colored_tokens(
        tokens=tokens,
        values=values,
        min_value=-top,
        max_value=top,
        negative_color=NEGATIVE_COLOR,
        positive_color=POSITIVE_COLOR,
    )
    caption = (
        f"{_LABELS.get(metric, metric)} of each source to query {query} ({tokens[-1]!r}), {where}. "
        f"Blue > 0, red < 0, white = 0, saturating at ±{top:.3g}; hover for the value." + _nan_note(n_nan)
    )
    if result.top_k is not None:
        caption += f" Only the {result.top_k} largest |values| were kept (top_k); the other sources show 0."
    return View(f"{result.model_name or 'model'} {where} query {query}", [(caption, view)])


# --------------------------------------------------------------------------- writing


def save_html(view: View | _Rendered | Sequence[View], path: str | Path, *, title: str | None = None) -> Path:
    """Write ``view`` (a :class:`View`, a list of them, or a bare circuitsvis ``RenderedHTML``) as one
    self-contained HTML file that works offline: circuitsvis' bundled JavaScript once, in a classic
    ``<script>`` in the head (:func:`circuitsvis_script`), then each panel's ``local_src`` without its own
    copy of the bundle (:func:`strip_circuitsvis_bundle`): its ``<div>`` and its render call. The CDN
    variant (``cdn_src``, an unpkg import) is never used.

    The file appears only when complete (:func:`mechgeom._io.atomic_write`); an error leaves no file.
    Raises ``ValueError`` if a panel would load a script from the network.
    """
    views: list[View]
    if isinstance(view, View):
        views = [view]
    elif hasattr(view, "local_src"):
        views = [View(title or "circuitsvis view", [("", view)])]  # type: ignore[list-item]
    else:
        views = list(view)  # type: ignore[arg-type]
    page_title = title or " | ".join(v.title for v in views)
    chunks = []
    for v in views:
        chunks.append(f"<h2>{html.escape(v.title)}</h2>\n")
        for caption, part in v.panels:
            chunk = _panel_html(caption, strip_circuitsvis_bundle(part.local_src))
            _check_offline(chunk)
            chunks.append(chunk)
    body = "".join(chunks)
    script = circuitsvis_script(body)
    _check_offline(script)
    path = Path(path)
    with atomic_write(path, "w") as f:
        f.write(
            '<!DOCTYPE html>\n<html>\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(page_title)}</title>\n{script}</head>\n<body>\n"
        )
        f.write(body)
        f.write("</body>\n</html>\n")
    return path


@functools.cache
def _inlined_bundle() -> str:
    """circuitsvis' ``dist/cdn/iife.js`` exactly as ``render_local`` inlines it into every ``local_src``."""
    import circuitsvis

    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    return path.read_text(encoding="utf-8").replace("</script>", "")


def circuitsvis_bundle() -> str:
    """circuitsvis' bundled JavaScript (``dist/cdn/iife.js``) as ``render_local`` inlines it, without its
    ``sourceMappingURL`` comment (a browser would ask for the map file)."""
    return re.sub(r"//# sourceMappingURL=\S*\s*$", "", _inlined_bundle())


def strip_circuitsvis_bundle(src: str) -> str:
    """A circuitsvis ``local_src`` without its inlined copy of the bundle: the ``<div>`` and the
    ``CircuitsVis.render`` call, for a page that loads the bundle once (:func:`circuitsvis_script`).

    A panel that holds no copy of this bundle (not made by this circuitsvis' ``render_local``) is returned
    unchanged: it still carries whatever it loads itself, so it works as before, only not smaller.
    """
    return src.replace(_inlined_bundle(), "")


def circuitsvis_script(body: str) -> str:
    """The bundle as one classic ``<script>`` for the ``<head>`` when ``body`` renders a circuitsvis view
    (calls ``CircuitsVis.``), else ``""``. A classic script defines the global ``CircuitsVis`` (in a module
    script it would stay module-scoped) before the panels' render calls, which are module scripts and so
    run after the document is parsed."""
    return f"<script>{circuitsvis_bundle()}</script>\n" if "CircuitsVis." in body else ""


def _check_offline(chunk: str) -> None:
    lowered = chunk.lower()
    if (
        "unpkg.com" in lowered
        or re.search(r"<script[^>]*\bsrc\s*=", lowered)
        or re.search(r"\bimport\b[^;\n]*\bfrom\s*[\"']https?://", lowered)
    ):
        raise ValueError("a panel loads JavaScript from the network; mechgeom writes offline HTML only")
