"""Headline statistics of contribution weights (``mechgeom.analyses.contribution.stats``) against brute-force
loops over (text, head, query, source), and the streamed overview against a result in memory."""

from __future__ import annotations

import json
import math
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens

from mechgeom.analyses.contribution.overview import ContributionOverview, contribution_overview
from mechgeom.analyses.contribution.stats import (
    HEAD_STATISTICS,
    ScoreTotals,
    add_sums,
    finish_sums,
    overview_summary,
    score_sums,
)
from mechgeom.analyses.contribution.weights import contribution_weights

SUMMARY_KEYS = [
    "n_heads",
    "n_texts",
    "sink_attention",
    "sink_contribution",
    "sink_value_weighted_normalized",
    "negative_share",
    "top1_agreement",
    "view_layer",
    "view_layer_tv",
]


def brute_stats(a: torch.Tensor, vn: torch.Tensor, c: torch.Tensor) -> dict[str, list[float]]:
    """The statistics of ``score_sums`` per head by plain loops over (text, head, query >= 1, source <= query)."""
    n_b, n_h, n_q, _ = a.shape
    out: dict[str, list[float]] = {k: [] for k in HEAD_STATISTICS}

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else math.nan

    for h in range(n_h):
        sink_a, sink_vn, sink_c, neg, finite, agree, tv = [], [], [], 0, 0, [], []
        for b in range(n_b):
            for i in range(1, n_q):
                sink_a.append(float(a[b, h, i, 0]))
                if not math.isnan(float(vn[b, h, i, 0])):
                    sink_vn.append(float(vn[b, h, i, 0]))
                if not math.isnan(float(c[b, h, i, 0])):
                    sink_c.append(float(c[b, h, i, 0]))
                srcs = [j for j in range(i + 1) if not math.isnan(float(c[b, h, i, j]))]
                neg += sum(float(c[b, h, i, j]) < 0 for j in srcs)
                finite += len(srcs)
                if srcs:  # top source, ties to the lower position: the first maximum in order
                    a_top = max(range(i + 1), key=lambda j: (float(a[b, h, i, j]), -j))
                    c_top = max(srcs, key=lambda j: (float(c[b, h, i, j]), -j))
                    agree.append(float(a_top == c_top))
                row = 0.5 * sum(abs(float(c[b, h, i, j]) - float(a[b, h, i, j])) for j in range(i + 1))
                if not math.isnan(row):
                    tv.append(row)
        out["sink_attention"].append(mean(sink_a))
        out["sink_value_weighted_normalized"].append(mean(sink_vn))
        out["sink_contribution"].append(mean(sink_c))
        out["negative_share"].append(neg / finite if finite else math.nan)
        out["top1_agreement"].append(mean(agree))
        out["tv_attention_contribution"].append(mean(tv))
    return out


def random_scores(seed: int, b: int = 3, h: int = 4, q: int = 7) -> tuple[torch.Tensor, ...]:
    """Causal ``a``; ``vn`` and ``c`` with NaN rows at their sources (a zero output norm), 0 above the
    diagonal; values on a coarse grid so that top-1 ties occur; the last head is NaN everywhere in ``c``."""
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    a = (torch.randn(b, h, q, q, generator=g) * 2).masked_fill(~causal, -math.inf).softmax(-1)
    a = (a * 4).round() / 4  # ties in attention
    c = ((torch.randn(b, h, q, q, generator=g) * 2).round() / 4).masked_fill(~causal, 0.0)
    vn = torch.rand(b, h, q, q, generator=g).masked_fill(~causal, 0.0)
    dead = torch.rand(b, h, q, generator=g) < 0.3
    dead[:, h - 1] = True
    nan_rows = dead[..., None] & causal
    return a, vn.masked_fill(nan_rows, math.nan), c.masked_fill(nan_rows, math.nan)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_score_sums_match_brute_force_loops(seed: int) -> None:
    a, vn, c = random_scores(seed)
    got = finish_sums(score_sums(a, vn, c))
    ref = brute_stats(a, vn, c)
    assert list(got) == list(HEAD_STATISTICS)
    for k in HEAD_STATISTICS:
        np.testing.assert_allclose(got[k].numpy(), ref[k], rtol=1e-6, atol=1e-7, equal_nan=True, err_msg=k)
    # head 3 has no finite contribution: its contribution statistics are NaN, attention's are not
    for k in ("sink_contribution", "sink_value_weighted_normalized", "negative_share", "top1_agreement"):
        assert math.isnan(float(got[k][3])), k
    assert not math.isnan(float(got["sink_attention"][3]))
    # the data are not degenerate: ties, negatives and disagreements all occur
    assert 0 < float(got["negative_share"][0]) < 1 and 0 < float(got["top1_agreement"][:3].min()) < 1


def test_sums_of_batches_add_up_to_the_whole() -> None:
    a, vn, c = random_scores(5, b=5)
    whole = score_sums(a, vn, c)
    parts = None
    for sl in (slice(0, 2), slice(2, 3), slice(3, 5)):
        parts = add_sums(parts, score_sums(a[sl], vn[sl], c[sl]))
    assert parts is not None
    for k, (s, n) in whole.items():
        assert torch.equal(parts[k][1], n.double()), k  # counts exactly
        torch.testing.assert_close(parts[k][0], s.double(), rtol=1e-6, atol=1e-6, msg=k)
    for k, v in finish_sums(parts).items():
        assert v.dtype == torch.float32
        torch.testing.assert_close(v, finish_sums(whole)[k], equal_nan=True, msg=k)


def zero_row_hook(pattern: torch.Tensor, hook, *, heads: list[int], query: int) -> torch.Tensor:
    pattern = pattern.clone()  # [batch head q k]: remove every source of one query (a zero output norm)
    pattern[:, heads, query, :] = 0.0
    return pattern


def test_overview_frames_match_loops_over_the_result() -> None:
    model = make_tiny(n_layers=2, n_kv=2, seed=30)
    tokens = random_tokens(3, 8, seed=31)
    hook = ("blocks.1.attn.hook_pattern", partial(zero_row_hook, heads=[0, 1, 2, 3], query=4))
    res = contribution_weights(model, tokens, extra_hooks=[hook])
    ov = contribution_overview(model, tokens, batch_size=2, extra_hooks=[hook])
    assert isinstance(ov, ContributionOverview)
    assert list(ov.heads.columns) == ["layer", "head", *HEAD_STATISTICS]
    assert list(ov.layers.columns) == ["layer", *HEAD_STATISTICS]
    assert (
        ov.to_frame() is ov.heads
        and ov.heads["layer"].dtype.kind == "i"
        and ov.heads["head"].dtype.kind == "i"
    )
    for li, layer in enumerate(res.layers):
        ref = brute_stats(
            *(
                res.intra[k][:, li].double()
                for k in ("attention", "value_weighted_normalized", "contribution")
            )
        )
        rows = ov.heads[ov.heads["layer"] == layer]
        assert rows["head"].tolist() == list(range(4))
        ref_l = brute_stats(
            *(
                res.inter[k][:, li, None].double()
                for k in ("attention", "value_weighted_normalized", "contribution")
            )
        )
        row_l = ov.layers[ov.layers["layer"] == layer]
        for k in HEAD_STATISTICS:
            np.testing.assert_allclose(
                rows[k].to_numpy(), ref[k], rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=k
            )
            np.testing.assert_allclose(
                row_l[k].to_numpy(), ref_l[k], rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=k
            )
    # the hook's NaN rows (layer 1, query 4, every head) are left out, so the statistics stay finite
    assert res.inter["contribution"][:, 1, 4, :5].isnan().all()
    assert ov.heads[list(HEAD_STATISTICS)].notna().all().all() and ov.layers.notna().all().all()
    # the view: text 0 of the layer of largest whole-layer TV
    tv = ov.layers["tv_attention_contribution"].to_numpy()
    assert ov.view_layer == int(ov.layers["layer"][int(np.argmax(tv))])
    assert ov.view.layers == [ov.view_layer] and set(ov.view.intra) == set(ov.view.inter) == {
        "attention",
        "contribution",
    }
    li = res.layers.index(ov.view_layer)
    for k in ("attention", "contribution"):
        torch.testing.assert_close(ov.view.intra[k][:, 0], res.intra[k][:1, li], equal_nan=True)
        torch.testing.assert_close(ov.view.inter[k][:, 0], res.inter[k][:1, li], equal_nan=True)
    assert torch.equal(ov.view.tokens, tokens[:1])


@pytest.mark.parametrize("layers", [None, [1]])
def test_overview_summary_equals_result_summary(layers) -> None:
    model = make_tiny(n_layers=3, n_kv=2, seed=32)
    tokens = random_tokens(5, 9, seed=33)
    from_result = contribution_weights(model, tokens, layers=layers).summary()
    streamed = contribution_overview(model, tokens, layers=layers, batch_size=1).summary()
    assert list(from_result) == SUMMARY_KEYS and list(streamed) == SUMMARY_KEYS
    n_layers = 3 if layers is None else 1
    assert from_result["n_heads"] == streamed["n_heads"] == 4 * n_layers
    assert from_result["n_texts"] == streamed["n_texts"] == 5
    assert from_result["view_layer"] == streamed["view_layer"]
    for k in SUMMARY_KEYS[2:]:
        assert streamed[k] == pytest.approx(from_result[k], rel=1e-5, abs=1e-7), k
    json.dumps(streamed)  # plain numbers
    assert all(
        type(streamed[k]) is float for k in SUMMARY_KEYS if k not in ("n_heads", "n_texts", "view_layer")
    )
    # the means are those of the per-head table, the TV that of the view layer
    ov = contribution_overview(model, tokens, layers=layers, batch_size=2)
    assert ov.summary()["sink_contribution"] == pytest.approx(float(ov.heads["sink_contribution"].mean()))
    view_tv = ov.layers.set_index("layer").loc[ov.view_layer, "tv_attention_contribution"]
    assert ov.summary()["view_layer_tv"] == pytest.approx(float(view_tv))
    assert set(ov.heads["layer"]) == set(range(3) if layers is None else layers)


def test_summary_needs_its_metrics_and_overview_checks_batch_size() -> None:
    model = make_tiny(seed=34)
    tokens = random_tokens(2, 6, seed=35)
    res = contribution_weights(model, tokens, intra=["attention", "contribution"])
    with pytest.raises(ValueError, match="value_weighted_normalized"):
        res.summary()
    res = contribution_weights(model, tokens, inter=["attention"])
    with pytest.raises(
        ValueError, match=r"inter-head metric\(s\) \['value_weighted_normalized', 'contribution'\]"
    ):
        res.summary()
    with pytest.raises(ValueError, match="batch_size"):
        contribution_overview(model, tokens, batch_size=0)


def test_overview_summary_with_every_tv_nan_falls_back_to_the_first_layer() -> None:
    heads = pd.DataFrame({"layer": [3], "head": [0], **{k: [math.nan] for k in HEAD_STATISTICS}})
    layers = pd.DataFrame({"layer": [3, 5], **{k: [math.nan, math.nan] for k in HEAD_STATISTICS}})
    s = overview_summary(heads, layers, n_texts=2)
    assert s["view_layer"] == 3 and math.isnan(s["view_layer_tv"]) and s["n_heads"] == 1


def test_score_totals_keep_layers_apart_and_sorted() -> None:
    a, vn, c = random_scores(7, b=2, h=2, q=5)
    totals = ScoreTotals()
    for layer in (4, 1):
        totals.add(
            layer,
            {"attention": a, "value_weighted_normalized": vn, "contribution": c},
            {"attention": a[:, 0], "value_weighted_normalized": vn[:, 0], "contribution": c[:, 0]},
        )
    assert totals.heads_frame()["layer"].tolist() == [1, 1, 4, 4]
    assert totals.layers_frame()["layer"].tolist() == [1, 4]
    np.testing.assert_allclose(
        totals.layers_frame()["sink_attention"].to_numpy(),
        [brute_stats(a, vn, c)["sink_attention"][0]] * 2,
        rtol=1e-6,
    )


def test_verbose_shows_a_bar_and_changes_nothing(capsys) -> None:
    model = make_tiny(seed=36)
    tokens = random_tokens(3, 6, seed=37)
    quiet = contribution_overview(model, tokens, batch_size=2)
    assert "contributions" not in capsys.readouterr().err
    loud = contribution_overview(model, tokens, batch_size=2, verbose=True)
    assert "contributions" in capsys.readouterr().err
    pd.testing.assert_frame_equal(quiet.heads, loud.heads)
