"""mechgeom.viz: offline HTML, atomic writes, a diverging colour scale, index checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from circuitsvis.utils.render import RenderedHTML
from conftest import make_tiny, random_tokens

from mechgeom.analyses.contribution.weights import contribution_weights
from mechgeom.viz.views import (
    NEGATIVE_COLOR,
    POSITIVE_COLOR,
    View,
    circuitsvis_bundle,
    circuitsvis_script,
    head_view,
    layer_view,
    save_html,
    strip_circuitsvis_bundle,
    token_view,
)

BUNDLE = Path(__import__("circuitsvis").__file__).parent / "dist" / "cdn" / "iife.js"


@pytest.fixture(scope="module")
def result():
    model = make_tiny(n_kv=2, seed=30)
    res = contribution_weights(model, random_tokens(2, 9, seed=31))
    res.str_tokens = [[f"t{i}" for i in range(9)], [f"u{i}" for i in range(8)] + ["</script>"]]
    return res


def props_of(html: str, element: str) -> dict:
    """The props circuitsvis passes to ``CircuitsVis.render`` for ``element`` (JSON in the inline script)."""
    m = re.search(rf"CircuitsVis\.{element},\s*(\{{.*?\}})\s*\)\s*</script>", html, re.S)
    assert m, f"no {element} render call"
    return json.loads(m.group(1))


def mix_with_white(color: str, white_share: float) -> tuple[float, float, float]:
    rgb = [int(color[k : k + 2], 16) for k in (1, 3, 5)]
    return tuple(c * (1 - white_share) + 255 * white_share for c in rgb)  # type: ignore[return-value]


def circuitsvis_color(
    value: float, vmin: float, vmax: float, neg: str, pos: str
) -> tuple[float, float, float]:
    """Port of circuitsvis 1.43's token colour rule (``iife.js``: ``e>=0 ? mix(pos, white, 1-e/max) :
    mix(neg, white, 1-(-e)/(-min))``, shares clamped to [0, 1])."""
    if value >= 0:
        return mix_with_white(pos, min(max(1 - value / vmax, 0), 1))
    return mix_with_white(neg, min(max(1 - (-value) / (-vmin), 0), 1))


def test_saved_html_is_self_contained_and_offline(result, tmp_path) -> None:
    view = head_view(result, 1, 2)
    path = save_html(view, tmp_path / "sub" / "head.html")
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    # circuitsvis' bundled JS is inlined (a known chunk of it), the CDN never appears
    bundle = BUNDLE.read_text(encoding="utf-8").replace("</script>", "")
    assert bundle[1000:3000] in text and len(text) > len(bundle)
    assert "unpkg" not in text
    assert not re.search(r"<script[^>]*\bsrc\s*=", text)
    assert not re.search(r"from\s*[\"']https?://", text)
    props = props_of(text, "AttentionHeads")
    assert props["attentionHeadNames"] == ["attention L1H2", "contribution L1H2"]
    torch.testing.assert_close(
        torch.tensor(props["attention"][1]), result.intra["contribution"][0, 1, 2], atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        torch.tensor(props["attention"][0]), result.intra["attention"][0, 1, 2], atol=1e-6, rtol=0
    )
    assert props["minValue"] == -1 and props["maxValue"] == 1 and props["maskUpperTri"] is True
    # a token that would close the inline <script> is defused
    text2 = save_html(token_view(result, 0, 8, head=1, batch=1), tmp_path / "tok.html").read_text()
    # (one </script> closes the page's bundle, one the panel's render call)
    assert text2.count("</script>") == 2 and "<\\u200b/script>" in text2  # JSON-escaped zero-width space


def test_save_html_writes_several_views_and_bare_rendered(result, tmp_path) -> None:
    both = [layer_view(result, 0), token_view(result, 1, 5)]
    text = save_html(both, tmp_path / "both.html").read_text()
    assert text.count("<h2>") == 2 and "AttentionHeads" in text and "ColoredTokens" in text
    names = props_of(text, "AttentionHeads")["attentionHeadNames"]
    assert names == [f"attention H{h}" for h in range(4)] + ["attention layer"] + [
        f"contribution H{h}" for h in range(4)
    ] + ["contribution layer"]
    bare = RenderedHTML(local_src="<div>local</div>", cdn_src='<script src="https://unpkg.com/x"></script>')
    text = save_html(bare, tmp_path / "bare.html", title="bare").read_text()
    assert "<div>local</div>" in text and "unpkg" not in text


def uuids(src: str) -> list[str]:
    return re.findall(r'<div id="(circuits-vis-[^"]+)"', src)


def test_save_html_inlines_the_bundle_once_per_file(result, tmp_path) -> None:
    inlined = BUNDLE.read_text(encoding="utf-8").replace("</script>", "")  # as render_local inlines it
    views = [
        head_view(result, 1, 2),
        layer_view(result, 0),
        token_view(result, 1, 5),
        token_view(result, 0, 8),
    ]
    parts = [part for v in views for _, part in v.panels]
    assert all(inlined in p.local_src for p in parts)  # each panel alone carries the whole bundle
    text = save_html(views, tmp_path / "four.html").read_text(encoding="utf-8")
    assert text.count("var CircuitsVis=") == 1 and text.count(inlined[1000:3000]) == 1
    # a classic script in the head (a global CircuitsVis), before every panel's module script
    head, body = text.split("</head>")
    assert re.search(r"<script>\s*\"use strict\";var CircuitsVis=", head)
    assert 'type="module"' not in head and "sourceMappingURL" not in text
    assert body.count('<script crossorigin type="module">') == len(parts) == 4
    # every panel keeps its div and its render call, with the same props as its local_src
    for p in parts:
        (uuid,) = uuids(p.local_src)
        assert body.count(f'<div id="{uuid}"') == 1
        assert re.search(rf'CircuitsVis\.render\(\s*"{uuid}",\s*CircuitsVis\.\w+,', body)
        assert strip_circuitsvis_bundle(p.local_src) in body
    # the size: one bundle plus each panel's own text, not one bundle per view
    stripped = sum(len(strip_circuitsvis_bundle(p.local_src)) for p in parts)
    assert stripped < len(inlined) / 20
    assert len(circuitsvis_bundle()) + stripped < len(text) < len(circuitsvis_bundle()) + stripped + 2000
    one = save_html(views[0], tmp_path / "one.html").read_text(encoding="utf-8")
    assert len(text) - len(one) < len(inlined) / 10  # three more views, far less than one more bundle
    # Jupyter's _repr_html_ stays self-contained: each panel with its own copy
    both = View("two", [*views[0].panels, *views[2].panels])
    assert both._repr_html_().count(inlined) == 2 and inlined in views[1]._repr_html_()


def test_save_html_keeps_a_panel_without_this_bundle_as_it_is(result, tmp_path) -> None:
    # A panel not made by this circuitsvis' render_local (here: its own tiny CircuitsVis) is written
    # unchanged, so it still works alone; the page adds the real bundle once for the other panels.
    foreign_src = (
        '<div id="circuits-vis-foreign"/><script type="module">var CircuitsVis={render(){}, Foo: 1};'
        'CircuitsVis.render("circuits-vis-foreign", CircuitsVis.Foo, {})</script>'
    )
    assert strip_circuitsvis_bundle(foreign_src) == foreign_src
    foreign = RenderedHTML(local_src=foreign_src, cdn_src="")
    view = head_view(result, 1, 2)
    text = save_html([view, View("foreign", [("", foreign)])], tmp_path / "mixed.html").read_text()
    assert foreign_src in text and text.count("var CircuitsVis=(") == 1
    (uuid,) = uuids(view.panels[0][1].local_src)
    assert re.search(rf'CircuitsVis\.render\(\s*"{uuid}"', text)
    alone = save_html(foreign, tmp_path / "foreign.html").read_text()
    assert foreign_src in alone and alone.count("var CircuitsVis=") == 2  # its own, and the page's
    # no circuitsvis view at all: no bundle
    assert circuitsvis_script("<div>plain</div>") == ""
    plain = save_html(RenderedHTML(local_src="<div>plain</div>", cdn_src=""), tmp_path / "plain.html")
    assert "<script" not in plain.read_text() and plain.stat().st_size < 1000


def test_save_html_is_atomic(result, tmp_path) -> None:
    class Exploding:
        cdn_src = ""

        @property
        def local_src(self) -> str:
            raise RuntimeError("render failed")

    target = tmp_path / "view.html"
    target.write_text("old content")
    view = head_view(result, 0, 0)
    view.panels.append(("second panel", Exploding()))  # the first panel is written, then the error
    with pytest.raises(RuntimeError, match="render failed"):
        save_html(view, target)
    assert target.read_text() == "old content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]  # no temp file left behind
    with pytest.raises(RuntimeError):
        save_html(View("x", [("", Exploding())]), tmp_path / "new.html")
    assert not (tmp_path / "new.html").exists()
    online = RenderedHTML(local_src='<script src="https://unpkg.com/circuitsvis"></script>', cdn_src="")
    with pytest.raises(ValueError, match="offline"):
        save_html(online, tmp_path / "online.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]


def test_negative_weights_get_a_different_colour(result, tmp_path) -> None:
    c_all = result.intra["contribution"][0, 1]  # [head q k]
    head, query = (int(x) for x in torch.nonzero((c_all < -0.01).any(-1))[0])  # a clearly negative source
    c = c_all[head]
    text = save_html(token_view(result, 1, query, head=head), tmp_path / "tok.html").read_text()
    props = props_of(text, "ColoredTokens")
    values = props["values"]
    assert props["tokens"] == [f"t{i}" for i in range(query + 1)]
    torch.testing.assert_close(torch.tensor(values), c[query, : query + 1], atol=1e-6, rtol=0)
    # symmetric scale: negatives are not clamped to white, and 0 sits in the middle
    assert props["minValue"] == -props["maxValue"] == -max(abs(v) for v in values)
    assert props["negativeColor"] == NEGATIVE_COLOR != props["positiveColor"] == POSITIVE_COLOR
    lo, hi = props["minValue"], props["maxValue"]
    colors = [circuitsvis_color(v, lo, hi, props["negativeColor"], props["positiveColor"]) for v in values]
    neg = [col for v, col in zip(values, colors, strict=True) if v < -0.01]
    pos = [col for v, col in zip(values, colors, strict=True) if v > 0.01]
    assert neg and pos
    # red-dominant for negative weights, blue-dominant for positive ones
    assert all(r > b for r, _, b in neg) and all(b > r for r, _, b in pos)
    # the head view passes the same diverging pair to attention_heads
    hprops = props_of(save_html(head_view(result, 1, 0), tmp_path / "h.html").read_text(), "AttentionHeads")
    assert (hprops["negativeColor"], hprops["positiveColor"]) == (NEGATIVE_COLOR, POSITIVE_COLOR)


def test_nan_rows_are_drawn_as_zero_and_counted(result) -> None:
    res = contribution_weights(make_tiny(seed=32), random_tokens(1, 5, seed=33), layers=[0])
    res.intra["contribution"][0, 0, 1, 3] = float("nan")
    view = head_view(res, 0, 1)
    caption, part = view.panels[0]
    assert "5 NaN weights" in caption
    props = props_of(part.local_src, "AttentionHeads")
    assert props["attention"][1][3] == [0.0] * 5


def test_bad_indices_raise(result) -> None:
    with pytest.raises(IndexError, match="not analysed"):
        head_view(result, 2, 0)
    with pytest.raises(IndexError, match="head 4"):
        head_view(result, 0, 4)
    with pytest.raises(IndexError, match="head -1"):
        head_view(result, 0, -1)
    with pytest.raises(IndexError, match="batch 2"):
        head_view(result, 0, 0, batch=2)
    with pytest.raises(IndexError, match="query 9"):
        token_view(result, 0, 9)
    with pytest.raises(IndexError, match="head 7"):
        token_view(result, 0, 3, head=7)
    with pytest.raises(IndexError, match="not analysed"):
        layer_view(result, 5)
    with pytest.raises(KeyError, match="no_such"):
        head_view(result, 0, 0, metrics=("attention", "no_such"))
    with pytest.raises(KeyError, match="head_share"):
        token_view(result, 0, 3, metric="head_share")


def test_numpy_and_tensor_indices_are_accepted(result) -> None:
    import numpy as np

    a = head_view(result, 1, np.int64(2)).panels[0][1].local_src
    b = head_view(result, 1, torch.tensor(2)).panels[0][1].local_src
    assert props_of(a, "AttentionHeads")["attention"] == props_of(b, "AttentionHeads")["attention"]
    with pytest.raises(IndexError, match="not an integer"):
        token_view(result, 0, 2.5)  # type: ignore[arg-type]
