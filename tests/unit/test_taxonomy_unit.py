"""Head taxonomy (``docs/definitions.md`` §6) against hand-built patterns and brute-force loops."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens
from refs import brute_winners

from mechgeom.analyses.heads import taxonomy_order
from mechgeom.analyses.heads.taxonomy import (
    LABELS,
    TABLE_COLUMNS,
    TaxonomyCollector,
    classify_heads,
    classify_heads_from_cache,
    label_agreement,
    label_distribution,
    label_from_fractions,
    layer_taxonomy,
    regime_summary,
    source_winners,
)
from mechgeom.hooks import expand_kv, has_hooks
from mechgeom.viz import plot_regime_grid

K = 10


def hand_values(b: int, k: int, h: int, d: int = 4, seed: int = 0) -> torch.Tensor:
    """Sink norm 0.1; non-sink norms decrease with position (2 - 0.1 j), random directions."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(b, k, h, d, generator=g)
    v = v / v.norm(dim=-1, keepdim=True)
    norms = torch.tensor([0.1] + [2 - 0.1 * j for j in range(1, k)])
    return v * norms[None, :, None, None]


def hand_patterns(b: int, k: int) -> torch.Tensor:
    """Head 0: current token; head 1: sink; head 2: uniform causal; head 3: previous token."""
    eye = torch.eye(k)
    sink = torch.zeros(k, k)
    sink[:, 0] = 1
    uni = torch.ones(k, k).tril()
    uni = uni / uni.sum(-1, keepdim=True)
    prev = torch.zeros(k, k)
    prev[0, 0] = 1
    prev[torch.arange(1, k), torch.arange(0, k - 1)] = 1
    return torch.stack([eye, sink, uni, prev])[None].expand(b, -1, -1, -1).clone()


def test_hand_built_patterns_get_their_regime() -> None:
    pat, v = hand_patterns(2, K), hand_values(2, K, 4)
    res = layer_taxonomy(pat, v)
    n = 2 * (K - 1)
    assert res["n_queries"].tolist() == [n] * 4
    # current-token head: every winner is i; sink head: every winner is 0
    assert res["n_cur"][0] == n and res["n_sink"][0] == 0
    assert res["n_sink"][1] == n and res["n_cur"][1] == 0
    # uniform head with norms decreasing after the sink: winner is position 1 for every i >= 1
    assert res["n_cur"][2] == 2 and res["n_sink"][2] == 0
    assert res["n_cur"][3] == 0 and res["n_sink"][3] == 2  # previous-token head: i = 1 picks the sink
    f_cur, f_sink = res["n_cur"] / n, res["n_sink"] / n
    labels = [
        label_from_fractions(c, s, 1 - c - s) for c, s in zip(f_cur.tolist(), f_sink.tolist(), strict=True)
    ]
    assert labels == ["Retriever", "Mixer", "Reset", "Reset"]
    assert torch.equal(res["winners"][..., 1:], torch.tensor(brute_winners(pat, v))[..., 1:])
    assert (res["winners"][..., 0] == -1).all()


def test_winners_match_bruteforce_with_ties_and_gqa() -> None:
    g = torch.Generator().manual_seed(1)
    b, h, k = 3, 4, 9
    # weights on a coarse grid and values with two equal norms per KV head: many exact ties
    logits = torch.randint(0, 3, (b, h, k, k), generator=g).float()
    mask = torch.ones(k, k, dtype=torch.bool).tril()
    pat = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    kv = torch.randint(1, 3, (b, k, 2, 1), generator=g).float() * torch.ones(b, k, 2, 3) / np.sqrt(3)
    v = expand_kv(kv, h)
    got = source_winners(pat, v)
    assert got.tolist() == brute_winners(pat, v)
    # an exact tie between the sink and the current token goes to the sink (lower position)
    tie_p = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    tie_v = torch.ones(1, 2, 1, 2)
    assert source_winners(tie_p, tie_v)[0, 0, 1].item() == 0


def test_label_tie_order() -> None:
    assert label_from_fractions(1 / 3, 1 / 3, 1 / 3) == "Retriever"
    assert label_from_fractions(0.5, 0.5, 0.0) == "Retriever"
    assert label_from_fractions(0.4, 0.1, 0.5) == "Reset"
    assert label_from_fractions(0.2, 0.4, 0.4) == "Mixer"
    assert label_from_fractions(0.0, 0.5, 0.5) == "Mixer"
    assert label_from_fractions(0.3, 0.2, 0.5) == "Reset"
    with pytest.raises(ValueError, match="NaN"):
        label_from_fractions(float("nan"), 0.0, 0.0)


def _overwrite(new: torch.Tensor):  # type: ignore[no-untyped-def]
    def hook(t: torch.Tensor, hook: object) -> torch.Tensor:
        return new.to(t.dtype).expand_as(t).clone()

    return hook


@pytest.mark.parametrize("n_kv", [None, 2])
def test_tiny_model_with_overwritten_patterns(n_kv: int | None) -> None:
    model = make_tiny(n_layers=2, n_heads=4, d_head=4, n_kv=n_kv, n_ctx=K)
    tokens = random_tokens(2, K)
    pat = hand_patterns(1, K)  # broadcast over the batch by the hooks
    n_kv_heads = n_kv or 4
    kv_vals = hand_values(1, K, n_kv_heads)
    hooks = []
    for layer in range(2):
        hooks.append((f"blocks.{layer}.attn.hook_pattern", _overwrite(pat)))
        hooks.append((f"blocks.{layer}.attn.hook_v", _overwrite(kv_vals)))
    res = classify_heads(model, tokens, extra_hooks=hooks, keep_winners=True, batch_size=1)
    table = res.to_frame()
    assert list(table.columns[: len(TABLE_COLUMNS)]) == list(TABLE_COLUMNS)
    assert table.loc[table["head"] == 0, "label"].eq("Retriever").all()
    assert table.loc[table["head"] == 1, "label"].eq("Mixer").all()
    assert table.loc[table["head"] == 2, "label"].eq("Reset").all()
    row = table[(table.layer == 1) & (table["head"] == 1)].iloc[0]
    assert (row.f_cur, row.f_sink, row.f_other, row.sink_rate) == (0.0, 1.0, 0.0, 1.0)
    expected = torch.tensor(brute_winners(pat, expand_kv(kv_vals, 4)))
    assert res.winners is not None and res.winners.shape == (2, 2, 4, K)
    assert torch.equal(res.winners[:, 1, :, 1:], expected[..., 1:].expand(2, -1, -1))
    # with the model's own patterns: same counts by hooks and from a cache
    own = classify_heads(model, tokens)
    _, cache = model.run_with_cache(tokens)
    cached = classify_heads_from_cache(model, cache)
    pd.testing.assert_frame_equal(own.to_frame(), cached.to_frame())
    assert not has_hooks(model)


def test_sink_rate_and_alignment_bruteforce() -> None:
    model = make_tiny(n_layers=1, n_kv=2, b_O=True)
    tokens = random_tokens(2, 8)
    _, cache = model.run_with_cache(tokens)
    pat = cache["blocks.0.attn.hook_pattern"].double()
    v = expand_kv(cache["blocks.0.attn.hook_v"], 4).double()
    W_O = model.blocks[0].attn.W_O.detach().double()
    table = classify_heads(model, tokens).to_frame()
    for h in range(4):
        rate, cs, cc = [], [], []
        for b in range(2):
            vt = [v[b, j, h] @ W_O[h] for j in range(8)]
            for i in range(1, 8):
                rate.append(float(pat[b, h, i, 0]))
                o = sum(pat[b, h, i, j] * vt[j] for j in range(i + 1))  # materialised head output
                cs.append(float(torch.nn.functional.cosine_similarity(o, vt[0], dim=0)))
                cc.append(float(torch.nn.functional.cosine_similarity(o, vt[i], dim=0)))
        row = table[table["head"] == h].iloc[0]
        assert row.sink_rate == pytest.approx(np.mean(rate), abs=1e-6)
        assert row.cos_out_sink == pytest.approx(np.mean(cs), abs=1e-5)
        assert row.cos_out_cur == pytest.approx(np.mean(cc), abs=1e-5)


def _table(labels: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "label": labels})


def test_distribution_and_agreement_bruteforce() -> None:
    a = _table(["Retriever", "Mixer", "Reset", "Mixer"])
    b = _table(["Retriever", "Reset", "Reset", "Mixer"]).iloc[::-1]  # row order must not matter
    c = _table(["Mixer", "Mixer", "Reset", "Mixer"])
    dist = label_distribution(a)
    assert dist.set_index("label")["n_heads"].to_dict() == {"Retriever": 1, "Mixer": 2, "Reset": 1}
    assert dist["share"].sum() == pytest.approx(1.0)
    agr = label_agreement({"a": a, "b": b, "c": c})
    pair = agr.pairwise.set_index(["a", "b"])["agreement"]
    la, lb, lc = (t.sort_values(["layer", "head"])["label"].tolist() for t in (a, b, c))
    for (x, y), (lx, ly) in {("a", "b"): (la, lb), ("a", "c"): (la, lc), ("b", "c"): (lb, lc)}.items():
        assert pair[(x, y)] == pytest.approx(np.mean([p == q for p, q in zip(lx, ly, strict=True)]))
        conf = agr.confusion[(x, y)]
        for r in LABELS:
            for col in LABELS:
                assert conf.loc[r, col] == sum(1 for p, q in zip(lx, ly, strict=True) if p == r and q == col)
    assert agr.all_agree == pytest.approx(np.mean([p == q == r for p, q, r in zip(la, lb, lc, strict=True)]))
    summary = regime_summary(a.assign(f_cur=[1.0, 0.0, 0.2, 0.1]))
    assert summary.set_index("label").loc["Mixer", "f_cur"] == pytest.approx(0.05)


def test_regime_grid_figure_colours_each_head() -> None:
    table = _table(["Retriever", "Mixer", "Reset", "Mixer"])
    fig = plot_regime_grid(table, title="t")
    img = fig.axes[0].images[0].get_array()
    assert np.asarray(img).tolist() == [[0, 1], [2, 1]]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_regime_grid_draws_each_head_at_its_layer_and_head() -> None:
    """Non-contiguous layers, shuffled rows, a head missing: cell [row of layer, head] = index of its label."""
    cells = {
        (0, 0): "Mixer",
        (0, 2): "Reset",
        (3, 1): "Retriever",
        (3, 2): "Mixer",
        (7, 0): "Reset",
        (7, 1): "Mixer",
    }
    cells[(0, 1)] = "Retriever"
    order = [(3, 2), (7, 1), (0, 1), (7, 0), (0, 2), (3, 1), (0, 0)]
    table = pd.DataFrame(
        {
            "layer": [la for la, _ in order],
            "head": [h for _, h in order],
            "label": [cells[lh] for lh in order],
        }
    )
    fig = plot_regime_grid(table)
    ax = fig.axes[0]
    img = np.ma.filled(np.ma.masked_invalid(np.asarray(ax.images[0].get_array(), dtype=float)), -1.0)
    want = np.full((3, 3), -1.0)  # rows: layers 0, 3, 7; (3, 0) and (7, 2) are not in the table
    for (la, h), lab in cells.items():
        want[[0, 3, 7].index(la), h] = LABELS.index(lab)
    np.testing.assert_array_equal(img, want)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "3", "7"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_taxonomy_order_breaks_exact_ties_by_layer_then_head() -> None:
    """Documented: Reset, Mixer, Retriever; ascending norm inside a regime; exact ties by ``(layer, head)``.

    Tied rows are listed in the reverse of that order, and inside the Reset tie ``(layer, head)`` and
    ``(head, layer)`` disagree, so ignoring, reversing or swapping the tie-break all change the answer."""
    rows = [  # (layer, head, label, norm)
        (1, 1, "Retriever", 0.2),
        (2, 1, "Mixer", 1.0),
        (1, 2, "Reset", 0.5),
        (0, 1, "Retriever", 0.2),
        (2, 0, "Mixer", 1.0),
        (1, 0, "Reset", 0.5),
        (2, 2, "Reset", 0.1),
        (0, 0, "Mixer", 1.0),
        (0, 2, "Reset", 0.5),
    ]
    table = pd.DataFrame(rows, columns=["layer", "head", "label", "out_norm"])
    expected = [(2, 2), (0, 2), (1, 0), (1, 2), (0, 0), (2, 0), (2, 1), (0, 1), (1, 1)]
    assert taxonomy_order(table) == expected
    assert taxonomy_order(table.iloc[::-1].reset_index(drop=True)) == expected  # row order must not matter
    norms = torch.zeros(3, 3)
    for layer, head, _, norm in rows:
        norms[layer, head] = norm
    assert taxonomy_order(table.drop(columns="out_norm"), norms) == expected
    assert taxonomy_order(table.drop(columns="out_norm"), norms.numpy()) == expected


def test_bad_input_errors() -> None:
    model = make_tiny(n_layers=2)
    tokens = random_tokens(1, 6)
    with pytest.raises(IndexError):
        classify_heads(model, tokens, layers=[5])
    with pytest.raises(IndexError, match="sink"):
        classify_heads(model, tokens, sink_positions=[6])
    with pytest.raises(ValueError, match="batch_size"):
        classify_heads(model, tokens, batch_size=0)
    with pytest.raises(ValueError, match="no query"):
        layer_taxonomy(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 2))
    with pytest.raises(ValueError, match="does not match"):
        source_winners(torch.ones(1, 2, 3, 3), torch.ones(1, 3, 4, 2))
    with pytest.raises(ValueError, match="at least two"):
        label_agreement([_table(["Mixer"] * 4)])
    with pytest.raises(ValueError, match="other"):
        label_agreement([_table(["Mixer"] * 4), _table(["Mixer"] * 4).assign(layer=[0, 0, 2, 2])])
    with pytest.raises(ValueError, match="lacks"):
        label_distribution(pd.DataFrame({"layer": [0]}))

    def boom(t: torch.Tensor, hook: object) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        classify_heads(model, tokens, extra_hooks=[("blocks.0.attn.hook_v", boom)])
    assert not has_hooks(model)


def test_collector_corpus_in_constructor_and_tokens_in_result() -> None:
    model = make_tiny(n_layers=2)
    tokens = random_tokens(2, 8)
    col = TaxonomyCollector(model, [0, 1], corpus="wiki")
    model.run_with_hooks(tokens, fwd_hooks=col.fwd_hooks)
    res = col.result(tokens)
    assert res.corpus == "wiki" and (res.to_frame()["corpus"] == "wiki").all()
    assert res.tokens is not None and torch.equal(res.tokens, tokens)
    assert col.result().tokens is None
    via_fn = classify_heads(model, tokens, corpus="wiki")
    pd.testing.assert_frame_equal(via_fn.to_frame(), res.to_frame())
    assert via_fn.tokens is not None and torch.equal(via_fn.tokens, tokens)
    _, cache = model.run_with_cache(tokens)
    cached = classify_heads_from_cache(model, cache, tokens=tokens, corpus="wiki")
    pd.testing.assert_frame_equal(cached.to_frame(), res.to_frame())
    assert cached.tokens is not None and torch.equal(cached.tokens, tokens)
    assert classify_heads_from_cache(model, cache).corpus == ""
    assert not has_hooks(model)


def _brute_summary_checks(table: pd.DataFrame, s: dict) -> None:  # type: ignore[type-arg]
    rows = table.to_dict(orient="records")
    assert s["n_heads"] == len(rows)
    for lab in LABELS:
        mine = [r for r in rows if r["label"] == lab]
        assert s["counts"][lab] == len(mine)
        assert s["shares"][lab] == pytest.approx(len(mine) / len(rows))
        align = next(a for a in s["alignment"] if a["label"] == lab)
        for col in ("cos_out_sink", "cos_out_cur", "sink_rate"):
            vals = [r[col] for r in mine if not np.isnan(r[col])]
            if vals:
                assert align[col] == pytest.approx(np.mean(vals), rel=1e-9)
            else:
                assert np.isnan(align[col])
    mixers = [r["cos_out_sink"] for r in rows if r["label"] == "Mixer"]
    retrievers = [r["cos_out_cur"] for r in rows if r["label"] == "Retriever"]
    for key, vals in (("cos_out_sink_mixer", mixers), ("cos_out_cur_retriever", retrievers)):
        if vals:
            assert s[key] == pytest.approx(np.mean(vals), rel=1e-9)
        else:
            assert np.isnan(s[key])


def test_summary_matches_bruteforce() -> None:
    import json

    model = make_tiny(n_layers=2, n_heads=4, d_head=4, n_ctx=K)
    tokens = random_tokens(2, K)
    pat, kv_vals = hand_patterns(1, K), hand_values(1, K, 4)
    hooks = []
    for layer in range(2):
        hooks.append((f"blocks.{layer}.attn.hook_pattern", _overwrite(pat)))
        hooks.append((f"blocks.{layer}.attn.hook_v", _overwrite(kv_vals)))
    res = classify_heads(model, tokens, extra_hooks=hooks, corpus="hand")
    s = res.summary()
    json.dumps(s)
    assert s["corpus"] == "hand"
    assert s["counts"] == {"Retriever": 2, "Mixer": 2, "Reset": 4}
    _brute_summary_checks(res.to_frame(), s)
    # every head a sink head: no Retriever, no Reset; their shares are 0.0 and their alignments NaN
    sink = hand_patterns(1, K)[:, 1:2].expand(1, 4, K, K).clone()
    only_mixers = [(f"blocks.{la}.attn.hook_pattern", _overwrite(sink)) for la in range(2)]
    s2 = classify_heads(model, tokens, extra_hooks=only_mixers).summary()
    assert s2["shares"] == {"Retriever": 0.0, "Mixer": 1.0, "Reset": 0.0}
    assert np.isnan(s2["cos_out_cur_retriever"]) and not np.isnan(s2["cos_out_sink_mixer"])
    _brute_summary_checks(classify_heads(model, tokens, extra_hooks=only_mixers).to_frame(), s2)
    # the model's own patterns
    own = classify_heads(model, tokens)
    _brute_summary_checks(own.to_frame(), own.summary())


def test_agreement_summary() -> None:
    a = _table(["Retriever", "Mixer", "Reset", "Mixer"])
    b = _table(["Retriever", "Reset", "Reset", "Mixer"])
    s = label_agreement({"a": a, "b": b}).summary()
    assert s["all_agree"] == pytest.approx(0.75)
    assert s["pairwise"] == [{"a": "a", "b": "b", "n_heads": 4, "agreement": 0.75}]
