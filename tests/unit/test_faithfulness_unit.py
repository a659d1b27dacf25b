"""Masking interventions, rankings and the resumable sweeps of mechgeom.analyses.faithfulness.curves on tiny models.

References are built by hand: per-query rankings by Python ``sorted`` over explicit loops, counts with
exact fractions, and perplexities/accuracies from plain forward passes.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens
from hypothesis import given, settings, strategies as st

from mechgeom import hooks as mg_hooks, viz
from mechgeom.analyses import faithfulness, scoring as evaluation
from mechgeom.analyses.contribution.weights import contribution_weights
from mechgeom.analyses.faithfulness import curves as fa, harness
from mechgeom.analyses.scoring import perplexity, text_nll
from mechgeom.data import TaskItem
from mechgeom.hooks import has_hooks, head_ablation_hooks, run_hooks
from mechgeom.sweep import hooks_fingerprint

GEO_METRICS = ("attention", "value_weighted", "value_weighted_normalized", "contribution")


# --------------------------------------------------------------------------- brute-force references


def brute_order(scores: list[float]) -> list[int]:
    """Sources of one query, best first: larger score first, NaN last, ties by lower position."""
    return sorted(
        range(len(scores)),
        key=lambda j: (math.isnan(scores[j]), 0.0 if math.isnan(scores[j]) else -scores[j], j),
    )


def brute_removed(scores: list[float], rate: float, mode: str) -> list[int]:
    order = brute_order(scores)
    n = math.ceil(Fraction(str(rate)) * len(scores))
    return order[:n] if mode == "comprehensiveness" else order[len(scores) - n :]


def brute_masks(
    model, tokens, metric: str, scope: str, rate: float, mode: str, extra_hooks=()
) -> dict[int, torch.Tensor]:
    """``{layer: [batch, head, q, k]}`` masks from clean-pass scores (``extra_hooks`` attached), with explicit
    loops."""
    res = contribution_weights(
        model,
        tokens,
        intra=[metric] if scope == "intra" else [],
        inter=[metric] if scope == "inter" else [],
        extra_hooks=extra_hooks,
    )
    b_n, pos = tokens.shape
    n_heads = model.cfg.n_heads
    masks = {}
    for li, layer in enumerate(res.layers):
        mask = torch.zeros(b_n, n_heads, pos, pos, dtype=torch.bool)
        for b in range(b_n):
            for h in range(n_heads):
                for i in range(pos):
                    if scope == "intra":
                        row = res.intra[metric][b, li, h, i, : i + 1].tolist()
                    else:
                        row = res.inter[metric][b, li, i, : i + 1].tolist()
                    for j in brute_removed(row, rate, mode):
                        mask[b, h, i, j] = True
        masks[layer] = mask
    return masks


def brute_hooks(masks: dict[int, torch.Tensor]):
    def zero(pattern, hook, mask):
        out = pattern.clone()
        out[mask] = 0.0
        return out

    return [(f"blocks.{la}.attn.hook_pattern", partial(zero, mask=m)) for la, m in masks.items()]


def run_capture(model, tokens, hooks, layers):
    """Logits, and each layer's pattern before and after ``hooks`` (readers around them)."""
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def read(pattern, hook, tag, layer):
        seen[(tag, layer)] = pattern.detach().clone()

    readers_pre = [(f"blocks.{la}.attn.hook_pattern", partial(read, tag="pre", layer=la)) for la in layers]
    readers_post = [(f"blocks.{la}.attn.hook_pattern", partial(read, tag="post", layer=la)) for la in layers]
    logits = run_hooks(model, tokens, [*readers_pre, *hooks, *readers_post], return_type="logits")
    return logits, seen


# --------------------------------------------------------------------------- counting and ranking


def test_n_removed_is_exact_ceiling() -> None:
    # 0.55 * 100 is 55.00000000000001 in binary floating point; np.arange gives 0.30000000000000004
    for rate in [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.25, 0.05, 0.55]:
        want = [math.ceil(Fraction(str(rate)) * (i + 1)) for i in range(300)]
        assert mg_hooks.n_removed(rate, 300).tolist() == want, rate
    assert mg_hooks.n_removed(float(np.arange(0, 1, 0.1)[3]), 10)[-1] == 3


@settings(max_examples=60, deadline=None)
@given(
    q=st.integers(1, 7),
    values=st.lists(st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0, float("nan")]), min_size=49, max_size=49),
)
def test_rank_sources_matches_python_sort(q: int, values: list[float]) -> None:
    # few distinct values -> many ties; NaN sprinkled in
    scores = torch.tensor(values[: q * q]).view(q, q)
    ranks = mg_hooks.rank_sources(scores)
    assert ranks.dtype == torch.uint8
    for i in range(q):
        order = brute_order(scores[i, : i + 1].tolist())
        assert [int(ranks[i, j]) for j in order] == list(range(i + 1))
        assert all(int(ranks[i, j]) > i for j in range(i + 1, q))  # future sources never compete


def test_rank_dtype_grows_with_length() -> None:
    assert mg_hooks.rank_sources(torch.rand(300, 300)).dtype == torch.int16
    r = mg_hooks.rank_sources(torch.rand(300, 300))
    assert sorted(r[299].tolist()) == list(range(300))


# --------------------------------------------------------------------------- the hook


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_rate_zero_gives_exactly_the_clean_logits(scope: str) -> None:
    model = make_tiny(n_kv=2)
    tokens = random_tokens(2, 10)
    clean = run_hooks(model, tokens, [], return_type="logits")
    rankings = faithfulness.source_rankings(model, tokens, scope=scope)
    for metric, ranking in rankings.items():
        for mode in mg_hooks.MODES:
            hooks = mg_hooks.masking_hooks(model, ranking=ranking, rate=0.0, mode=mode)
            assert len(hooks) == model.cfg.n_layers
            assert torch.equal(run_hooks(model, tokens, hooks, return_type="logits"), clean), (metric, mode)


@pytest.mark.parametrize("metric", GEO_METRICS)
@pytest.mark.parametrize("scope", ["intra", "inter"])
@pytest.mark.parametrize("mode", mg_hooks.MODES)
def test_ranked_mask_equals_brute_force(metric: str, scope: str, mode: str) -> None:
    model = make_tiny(n_kv=2)
    tokens = random_tokens(2, 10, seed=3)
    rate = 0.3  # 0.3 * 10 must count 3, not 4
    masks = brute_masks(model, tokens, metric, scope, rate, mode)
    ranking = faithfulness.source_rankings(model, tokens, [metric], scope=scope)[metric]
    for layer, m in masks.items():
        assert torch.equal(ranking.mask(layer, rate, mode).expand_as(m), m)
    layers = list(masks)
    mine, seen = run_capture(
        model, tokens, mg_hooks.masking_hooks(model, ranking=ranking, rate=rate, mode=mode), layers
    )
    ref, seen_ref = run_capture(model, tokens, brute_hooks(masks), layers)
    for la in layers:
        assert torch.equal(seen[("post", la)], seen_ref[("post", la)])
        # removed pairs are exactly 0, the rest untouched (no renormalisation)
        pre, post = seen[("pre", la)], seen[("post", la)]
        assert torch.equal(post, torch.where(masks[la], torch.zeros_like(pre), pre))
        assert not torch.allclose(post.sum(-1), torch.ones_like(post.sum(-1)))
    assert torch.allclose(mine, ref, atol=1e-6)
    assert not torch.allclose(mine, run_hooks(model, tokens, [], return_type="logits"), atol=1e-3)


@pytest.mark.parametrize("mode", mg_hooks.MODES)
def test_rate_one_leaves_only_b_O(mode: str) -> None:
    model = make_tiny(attn_only=True, b_O=True)
    tokens = random_tokens(2, 9)
    ranking = faithfulness.source_rankings(model, tokens, ["contribution"])["contribution"]
    outs: dict[int, torch.Tensor] = {}

    def read(t, hook, layer):
        outs[layer] = t.detach().clone()

    readers = [(f"blocks.{la}.hook_attn_out", partial(read, layer=la)) for la in range(model.cfg.n_layers)]
    run_hooks(model, tokens, [*mg_hooks.masking_hooks(model, ranking=ranking, rate=1.0, mode=mode), *readers])
    for la in range(model.cfg.n_layers):
        b_O = model.blocks[la].attn.b_O.detach()
        assert b_O.abs().max() > 0.1
        assert torch.allclose(outs[la], b_O.expand_as(outs[la]), atol=1e-6)


def test_intra_ranking_is_applied_per_head() -> None:
    model = make_tiny()
    tokens = random_tokens(1, 12, seed=5)
    res = contribution_weights(model, tokens, intra=["contribution"], inter=[])
    ranking = faithfulness.source_rankings(model, tokens, ["contribution"])["contribution"]
    mask = ranking.mask(0, 0.5, "comprehensiveness")[0]  # [head, q, k]
    assert mask.shape[0] == model.cfg.n_heads
    assert any(not torch.equal(mask[0], mask[h]) for h in range(1, model.cfg.n_heads))
    for h in range(model.cfg.n_heads):
        for i in range(12):
            want = set(
                brute_removed(
                    res.intra["contribution"][0, 0, h, i, : i + 1].tolist(), 0.5, "comprehensiveness"
                )
            )
            assert set(torch.nonzero(mask[h, i]).flatten().tolist()) == want
    # giving head 0 head 1's ranking changes the result
    swapped = faithfulness.SourceRanking(
        "contribution", "intra", {la: r.clone() for la, r in ranking.ranks.items()}
    )
    swapped.ranks[0][:, 0] = ranking.ranks[0][:, 1]
    a = run_hooks(
        model, tokens, mg_hooks.masking_hooks(model, ranking=ranking, rate=0.5), return_type="logits"
    )
    b = run_hooks(
        model, tokens, mg_hooks.masking_hooks(model, ranking=swapped, rate=0.5), return_type="logits"
    )
    assert not torch.allclose(a, b, atol=1e-4)
    # inter-head: one ranking, the same mask on every head
    inter = faithfulness.source_rankings(model, tokens, ["contribution"], scope="inter")["contribution"]
    assert inter.ranks[0].shape[1] == 1
    _, seen = run_capture(model, tokens, mg_hooks.masking_hooks(model, ranking=inter, rate=0.5), [0])
    zeros = seen[("post", 0)][0] == 0
    assert all(torch.equal(zeros[0], zeros[h]) for h in range(model.cfg.n_heads))


def test_explicit_mask_three_and_four_dims() -> None:
    model = make_tiny()
    tokens = random_tokens(2, 8)
    g = torch.Generator().manual_seed(0)
    m3 = torch.rand(2, 8, 8, generator=g) < 0.3
    m4 = m3[:, None].expand(2, model.cfg.n_heads, 8, 8).clone()
    a, seen = run_capture(model, tokens, mg_hooks.masking_hooks(model, mask=m3, layers=[1]), [1])
    b = run_hooks(model, tokens, mg_hooks.masking_hooks(model, mask=m4, layers=[1]), return_type="logits")
    assert torch.equal(a, b)
    pre, post = seen[("pre", 1)], seen[("post", 1)]
    assert torch.equal(post, torch.where(m4, torch.zeros_like(pre), pre))
    # a layer dict masks only the named layers
    c = run_hooks(model, tokens, mg_hooks.masking_hooks(model, mask={1: m3}), return_type="logits")
    assert torch.equal(a, c)


def test_random_ranking_reproducible_and_batch_independent() -> None:
    model = make_tiny()
    tokens = random_tokens(3, 10, seed=1)
    a = faithfulness.source_rankings(model, tokens, ["random"], seed=0)["random"]
    b = faithfulness.source_rankings(model, tokens, ["random"], seed=0)["random"]
    c = faithfulness.source_rankings(model, tokens, ["random"], seed=1)["random"]
    alone = faithfulness.source_rankings(model, tokens[1:2], ["random"], seed=0)["random"]
    assert a.same_as(b)
    assert not a.same_as(c)
    assert all(torch.equal(a.ranks[la][1:2], alone.ranks[la]) for la in a.layers)
    assert not torch.equal(a.ranks[0][0], a.ranks[1][0])  # layers draw differently
    assert not torch.equal(a.ranks[0][0, 0], a.ranks[0][0, 1])  # heads draw differently (intra)


# --------------------------------------------------------------------------- the sweeps


def test_perplexity_curves_numbers_match_a_hand_computation() -> None:
    model = make_tiny(n_kv=2)
    tokens = random_tokens(4, 10, seed=7)
    frame = faithfulness.perplexity_curves(
        model, tokens, ["contribution", "random"], rates=(0.0, 0.5), batch_size=3, verbose=False
    )
    assert list(frame.columns[:8]) == [
        "metric",
        "mode",
        "rate",
        "ppl",
        "delta_ppl",
        "delta_nll",
        "ci_low",
        "ci_high",
    ]
    assert {"n_texts", "layers", "scope"} <= set(frame.columns)
    assert len(frame) == 2 * 2 * 2 and (frame["n_texts"] == 4).all() and (frame["layers"] == "all").all()
    clean = perplexity(model, tokens)
    assert np.allclose(frame["clean_ppl"], clean, rtol=1e-5)
    zero = frame[frame["rate"] == 0]
    assert (zero["delta_ppl"] == 0).all() and (zero["ci_low"] == 0).all()
    for mode in mg_hooks.MODES:
        masks = brute_masks(model, tokens, "contribution", "intra", 0.5, mode)
        nll = text_nll(model, tokens, brute_hooks(masks), batch_size=4)
        row = frame[
            (frame["metric"] == "contribution") & (frame["mode"] == mode) & (frame["rate"] == 0.5)
        ].iloc[0]
        assert row["ppl"] == pytest.approx(float(torch.exp(nll.mean())), rel=1e-5)
        assert row["delta_ppl"] == pytest.approx(row["ppl"] - clean, rel=1e-4)
        clean_nll = text_nll(model, tokens)
        assert row["delta_nll"] == pytest.approx(float((nll - clean_nll).mean()), rel=1e-4, abs=1e-6)
        assert row["ci_low"] <= row["ci_high"]


def test_resume_after_interruption_gives_the_same_table(tmp_path, monkeypatch) -> None:
    model = make_tiny()
    tokens = random_tokens(5, 8, seed=2)
    kw = dict(
        metrics=("attention", "contribution", "random"), rates=(0.0, 0.5, 1.0), batch_size=2, verbose=False
    )
    full = faithfulness.perplexity_curves(model, tokens, checkpoint=tmp_path / "full.csv", **kw)

    real = harness.masked_pass
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 7:
            raise RuntimeError("simulated interruption")
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "masked_pass", flaky)
    out = tmp_path / "run.csv"
    with pytest.raises(RuntimeError, match="simulated"):
        faithfulness.perplexity_curves(model, tokens, checkpoint=out, **kw)
    assert not has_hooks(model)
    assert not out.exists()
    partial_rows = pd.read_csv(tmp_path / "run.per_text.csv")
    assert 0 < len(partial_rows) < len(pd.read_csv(tmp_path / "full.per_text.csv"))

    counted = {"n": 0}

    def counting(*args, **kwargs):
        counted["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "masked_pass", counting)
    resumed = faithfulness.perplexity_curves(model, tokens, checkpoint=out, **kw)
    pd.testing.assert_frame_equal(resumed, full)
    pd.testing.assert_frame_equal(pd.read_csv(out), pd.read_csv(tmp_path / "full.csv"))
    rec = pd.read_csv(tmp_path / "run.per_text.csv")
    assert not rec.duplicated(["metric", "mode", "rate", "unit_hash"]).any()
    assert len(rec) == len(pd.read_csv(tmp_path / "full.per_text.csv"))
    # 3 batches x 3 metrics x 2 modes x 2 rates = 36 passes; 7 were done before the interruption
    assert counted["n"] == 36 - 7

    # a finished sweep reruns without a forward pass; other settings are refused
    counted["n"] = 0
    faithfulness.perplexity_curves(model, tokens, checkpoint=out, **kw)
    assert counted["n"] == 0
    with pytest.raises(ValueError, match="seed"):
        faithfulness.perplexity_curves(model, tokens, checkpoint=out, seed=1, **kw)
    with pytest.raises(ValueError, match="scope"):
        faithfulness.perplexity_curves(model, tokens, checkpoint=out, scope="inter", **kw)


def test_task_accuracy_matches_per_sequence_scoring(tmp_path, monkeypatch) -> None:
    model = make_tiny(n_ctx=40)
    vocab = model.cfg.d_vocab

    def encode(_model, text, *, prepend_bos):
        return [ord(ch) % vocab for ch in text]

    monkeypatch.setattr(evaluation, "_encode", encode)
    items = [
        TaskItem("boolq", "the sky is blue. is it?", (" no", " yes"), 1),
        TaskItem("boolq", "water is dry? answer", (" no", " yes"), 0),
        TaskItem("mmlu", "pick one:", (" A", " B", " C", " D"), 2),
        TaskItem("winogrande", "she gave him", (" the cat back", " a book"), 0),
    ]
    frame = faithfulness.task_accuracy_curves(
        model,
        items,
        ["attention", "random"],
        rates=(0.0, 0.5),
        batch_size=3,
        checkpoint=tmp_path / "t.csv",
        verbose=False,
    )
    units, owner = fa._task_units(model, items, 40)
    rec = pd.read_csv(tmp_path / "t.per_choice.csv")
    preds: dict[tuple[str, str, float], list[int]] = {}
    for key in [("clean", "clean", 0.0)] + [
        (m, mo, 0.5) for m in ("attention", "random") for mo in mg_hooks.MODES
    ]:
        scores = {}
        for u, (i, c) in enumerate(owner):
            seq = units.tokens[u, : units.lengths[u]][None]
            n_ctx = int(torch.nonzero(units.targets[u])[0]) + 1
            hooks = []
            if key[0] != "clean":
                ranking = faithfulness.source_rankings(model, seq, [key[0]])[key[0]]
                hooks = mg_hooks.masking_hooks(model, ranking=ranking, rate=key[2], mode=key[1])
            logp = run_hooks(model, seq, hooks, return_type="logits").log_softmax(-1)[0]
            want = sum(float(logp[t - 1, seq[0, t]]) for t in range(n_ctx, seq.shape[1]))
            got = rec[
                (rec.metric == key[0])
                & (rec["mode"] == key[1])
                & (rec.rate == key[2])
                & (rec.unit_hash == units.hashes[u])
            ]
            assert len(got) == 1
            assert got["logprob"].iloc[0] == pytest.approx(want, rel=1e-4, abs=1e-4)
            scores[(i, c)] = want
        preds[key] = [
            int(np.argmax([scores[(i, c)] for c in range(len(it.choices))])) for i, it in enumerate(items)
        ]
    correct = {
        k: np.array([p == it.answer for p, it in zip(v, items, strict=True)], dtype=float)
        for k, v in preds.items()
    }
    for _, row in frame.iterrows():
        sel = np.array([row.task in ("all", it.task) for it in items])
        key = ("clean", "clean", 0.0) if row.rate == 0 else (row.metric, row["mode"], row.rate)
        assert row.accuracy == pytest.approx(correct[key][sel].mean())
        # the accuracy's own interval: the percentile bootstrap over items of the 0/1 correctness
        lo, hi = evaluation.bootstrap_ci(correct[key][sel], n_boot=1000, seed=0)
        assert (row.accuracy_ci_low, row.accuracy_ci_high) == pytest.approx((lo, hi))
        assert row.accuracy_ci_low <= row.accuracy <= row.accuracy_ci_high
        assert row.delta_accuracy == pytest.approx(
            (correct[key][sel] - correct[("clean", "clean", 0.0)][sel]).mean()
        )
    assert set(frame.task) == {"boolq", "mmlu", "winogrande", "all"}
    assert (frame[frame.task == "all"].n_items == 4).all()


def test_extra_hooks_run_in_every_pass_and_match_a_brute_force(tmp_path) -> None:
    """A zero ablation of two heads, given as ``extra_hooks``: the clean pass is the ablated model's, the rankings
    come from the ablated clean pass, and the masked pass runs ablation and masking together."""
    model = make_tiny(n_kv=2)
    tokens = random_tokens(4, 10, seed=7)
    abl = head_ablation_hooks(model, [(0, 1), (1, 2)])
    kw = dict(metrics=("contribution", "random"), rates=(0.0, 0.5), batch_size=3, verbose=False)
    frame = faithfulness.perplexity_curves(
        model, tokens, extra_hooks=abl, checkpoint=tmp_path / "abl.csv", **kw
    )
    plain = faithfulness.perplexity_curves(model, tokens, **kw)
    assert not has_hooks(model)
    clean_nll = text_nll(model, tokens, abl)
    clean = float(torch.exp(clean_nll.mean()))
    assert np.allclose(frame["clean_ppl"], clean, rtol=1e-5)
    assert abs(clean - perplexity(model, tokens)) > 1e-3  # the ablation changes the clean PPL
    assert np.allclose(plain["clean_ppl"], perplexity(model, tokens), rtol=1e-5)
    masks = brute_masks(model, tokens, "contribution", "intra", 0.5, "comprehensiveness", extra_hooks=abl)
    nll = text_nll(model, tokens, [*abl, *brute_hooks(masks)], batch_size=4)
    row = frame[
        (frame["metric"] == "contribution") & (frame["mode"] == "comprehensiveness") & (frame["rate"] == 0.5)
    ].iloc[0]
    assert row["ppl"] == pytest.approx(float(torch.exp(nll.mean())), rel=1e-5)
    assert row["delta_ppl"] == pytest.approx(row["ppl"] - clean, rel=1e-4)
    assert row["delta_nll"] == pytest.approx(float((nll - clean_nll).mean()), rel=1e-4, abs=1e-6)
    # the rankings are those of the ablated model, not of the plain one
    ablated = faithfulness.source_rankings(model, tokens, ["contribution"], extra_hooks=abl)["contribution"]
    plain_ranking = faithfulness.source_rankings(model, tokens, ["contribution"])["contribution"]
    for la, m in masks.items():
        assert torch.equal(ablated.mask(la, 0.5, "comprehensiveness").expand_as(m), m)
    assert not ablated.same_as(plain_ranking)
    # the hooks are part of the store's fingerprint, both ways, by their code and data (the same in another
    # process)
    with pytest.raises(
        ValueError, match=r"extra_hooks: stored blocks\.0\.attn\.hook_z: .*replace_z_hook.*, now none"
    ):
        fa.perplexity_curves(model, tokens, checkpoint=tmp_path / "abl.csv", **kw)
    other = head_ablation_hooks(model, [(0, 1)])
    with pytest.raises(ValueError, match="extra_hooks"):
        fa.perplexity_curves(model, tokens, extra_hooks=other, checkpoint=tmp_path / "abl.csv", **kw)
    fa.perplexity_curves(model, tokens, checkpoint=tmp_path / "plain.csv", **kw)
    with pytest.raises(ValueError, match=r"extra_hooks: stored none, now blocks\.0\.attn\.hook_z: "):
        fa.perplexity_curves(model, tokens, extra_hooks=abl, checkpoint=tmp_path / "plain.csv", **kw)
    again = fa.perplexity_curves(
        model,
        tokens,
        extra_hooks=head_ablation_hooks(model, [(0, 1), (1, 2)]),
        checkpoint=tmp_path / "abl.csv",
        **kw,
    )
    pd.testing.assert_frame_equal(again, frame)
    label = hooks_fingerprint(abl)
    assert "0x" not in label and "replace_z_hook" in label
    means = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_head)
    mean_a = hooks_fingerprint(head_ablation_hooks(model, [(0, 1)], mode="mean", means=means))
    mean_b = hooks_fingerprint(head_ablation_hooks(model, [(0, 1)], mode="mean", means=means + 1e-3))
    assert mean_a != mean_b  # tensors enter by content, not by a rounded print


# --------------------------------------------------------------------------- judging the metrics


def _curves(means: dict[str, dict[str, float]], rates=(0.3, 0.6)) -> pd.DataFrame:
    """A ΔPPL table: per mode and metric, ``delta_ppl = mean - 1`` at the first rate > 0 and ``mean + 1`` at the
    second (so the mean over rates > 0 is ``mean``), and 0 at rate 0."""
    rows = []
    for mode, by_metric in means.items():
        for metric, v in by_metric.items():
            rows.append({"mode": mode, "metric": metric, "rate": 0.0, "delta_ppl": 0.0, "clean_ppl": 7.5})
            for r, d in zip(rates, (-1.0, 1.0), strict=True):
                rows.append({"mode": mode, "metric": metric, "rate": r, "delta_ppl": v + d, "clean_ppl": 7.5})
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    ("comp", "suff", "verdicts", "ties"),
    [
        ((1, 2, 3, 4), (4, 3, 2, 1), ("holds", "holds"), ([], [])),
        (
            (1, 2, 2, 4),
            (4, 3, 3, 1),
            ("holds up to ties", "holds up to ties"),
            ([["value_weighted", "value_weighted_normalized"]],) * 2,
        ),
        ((4, 2, 3, 1), (4, 3, 2, 1), ("does not hold", "holds"), ([], [])),
        (
            (1, 1, 1, 1),
            (1, 2, 2, 2),
            ("holds up to ties", "does not hold"),
            (
                [
                    ["attention", "value_weighted"],
                    ["value_weighted", "value_weighted_normalized"],
                    ["value_weighted_normalized", "contribution"],
                ],
                [
                    ["value_weighted", "value_weighted_normalized"],
                    ["value_weighted_normalized", "contribution"],
                ],
            ),
        ),
    ],
)
def test_faithfulness_summary_verdicts(comp, suff, verdicts, ties) -> None:
    claimed = list(GEO_METRICS)
    comp_means = {**dict(zip(claimed, comp, strict=True)), "random": 0.5}
    suff_means = {**dict(zip(claimed, suff, strict=True)), "random": 9.0}
    frame = _curves({"comprehensiveness": comp_means, "sufficiency": suff_means})
    out = faithfulness.faithfulness_summary(frame)
    assert out["clean_ppl"] == 7.5 and out["rates"] == [0.0, 0.3, 0.6] and out["claimed"] == claimed
    json.dumps(out)  # plain JSON
    for (mode, means), verdict, tied in zip(
        (("comprehensiveness", comp_means), ("sufficiency", suff_means)), verdicts, ties, strict=True
    ):
        got = out["modes"][mode]
        higher = mode == "comprehensiveness"
        assert got["higher_is_more_faithful"] is higher
        assert got["verdict"] == verdict and got["ties"] == tied
        # the ranking by hand: mean over the rates > 0, most faithful first
        assert dict(got["ranking"]) == pytest.approx(means) and len(got["ranking"]) == len(means)
        vals = [v for _, v in got["ranking"]]
        assert vals == sorted(vals, reverse=higher)
        if len(set(means.values())) == len(means):  # no ties: one order
            by_hand = sorted(means, key=lambda m: -means[m] if higher else means[m])
            assert [m for m, _ in got["ranking"]] == by_hand


def test_faithfulness_summary_missing_metric_and_mode() -> None:
    frame = _curves({"comprehensiveness": {"attention": 1.0, "contribution": 2.0}})
    out = faithfulness.faithfulness_summary(frame)
    assert list(out["modes"]) == ["comprehensiveness"]  # no sufficiency rows: no entry
    assert out["modes"]["comprehensiveness"]["verdict"] == "does not hold"  # two claimed metrics are missing
    got = faithfulness.faithfulness_summary(frame, claimed=["attention", "contribution"])["modes"][
        "comprehensiveness"
    ]
    assert got["verdict"] == "holds" and got["ranking"] == [["contribution", 2.0], ["attention", 1.0]]


def test_area_ordering_is_the_trapezoid_area() -> None:
    rates = (0.0, 0.2, 0.5, 1.0)
    curves = {"attention": (0, 1, 3, 4), "contribution": (0, 2, 2, 9), "random": (0, 0.1, 0.2, 0.3)}
    rows = [
        {"mode": mode, "metric": m, "rate": r, "delta_ppl": y * (1 if mode == "comprehensiveness" else 0.5)}
        for mode in mg_hooks.MODES
        for m, ys in curves.items()
        for r, y in reversed(list(zip(rates, ys, strict=True)))  # unsorted on purpose
    ]
    out = faithfulness.area_ordering(pd.DataFrame(rows))
    for mode, scale in (("comprehensiveness", 1.0), ("sufficiency", 0.5)):
        want = {
            m: sum((rates[k + 1] - rates[k]) * (ys[k] + ys[k + 1]) / 2 * scale for k in range(3))
            for m, ys in curves.items()
        }
        assert out[mode]["area"] == pytest.approx(want)
        order = sorted(want, key=want.get, reverse=mode == "sufficiency")  # least faithful first
        assert out[mode]["least_to_most_faithful"] == order
        assert out[mode]["random_rank"] == order.index("random")
    assert out["comprehensiveness"]["agrees_with_paper_order"]  # attention (1.85) < contribution (4.1)
    assert not out["sufficiency"]["agrees_with_paper_order"]


# --------------------------------------------------------------------------- errors and plots


def test_bad_input_is_refused_clearly() -> None:
    model = make_tiny()
    tokens = random_tokens(2, 6)
    run = partial(faithfulness.perplexity_curves, model, tokens, verbose=False)
    for rates in [(-0.1,), (1.5,), (float("nan"),), ()]:
        with pytest.raises(ValueError, match="rate"):
            run(rates=rates)
    with pytest.raises(ValueError, match=r"unknown intra-head ranking metric.*'foo'"):
        run(metrics=("contribution", "foo"))
    with pytest.raises(ValueError, match="unknown mode 'comprehensive'"):
        run(modes=("comprehensive",))
    with pytest.raises(ValueError, match="scope"):
        run(scope="layer")
    with pytest.raises(ValueError, match="empty corpus"):
        faithfulness.perplexity_curves(model, torch.zeros(0, 6, dtype=torch.long), verbose=False)
    with pytest.raises(ValueError, match="empty corpus"):
        faithfulness.perplexity_curves(model, [], verbose=False)
    with pytest.raises(ValueError, match="batch_size"):
        run(batch_size=0)
    with pytest.raises(ValueError, match=r"\.csv or \.parquet"):
        run(checkpoint="table.txt")
    with pytest.raises(IndexError, match="out of range"):
        run(layers=[5])
    with pytest.raises(ValueError, match="no items"):
        faithfulness.task_accuracy_curves(model, [], verbose=False)
    ranking = faithfulness.source_rankings(model, tokens, ["attention"])["attention"]
    with pytest.raises(ValueError, match="exactly one"):
        mg_hooks.masking_hooks(model)
    with pytest.raises(ValueError, match="exactly one"):
        mg_hooks.masking_hooks(model, mask=torch.zeros(2, 6, 6, dtype=torch.bool), ranking=ranking)
    with pytest.raises(ValueError, match="rate"):
        mg_hooks.masking_hooks(model, ranking=ranking)
    with pytest.raises(ValueError, match="rate"):
        mg_hooks.masking_hooks(model, ranking=ranking, rate=2.0)
    with pytest.raises(ValueError, match="unknown mode"):
        mg_hooks.masking_hooks(model, ranking=ranking, rate=0.5, mode="suff")
    with pytest.raises(TypeError, match="boolean"):
        mg_hooks.masking_hooks(model, mask=torch.zeros(2, 6, 6))
    with pytest.raises(ValueError, match="not ranked"):
        mg_hooks.masking_hooks(
            model,
            ranking=faithfulness.source_rankings(model, tokens, ["attention"], layers=[0])["attention"],
            rate=0.1,
            layers=[1],
        )


def test_no_hooks_left_after_a_hook_raises() -> None:
    model = make_tiny()
    tokens = random_tokens(2, 6)
    wrong = torch.zeros(3, 6, 6, dtype=torch.bool)  # batch 3 vs 2
    with pytest.raises(ValueError, match="does not fit the pattern"):
        run_hooks(model, tokens, mg_hooks.masking_hooks(model, mask=wrong))
    assert not has_hooks(model)
    ranking = faithfulness.source_rankings(model, tokens[:1], ["attention"])["attention"]
    with pytest.raises(ValueError, match="does not fit the pattern"):
        run_hooks(model, tokens, mg_hooks.masking_hooks(model, ranking=ranking, rate=0.5))
    assert not has_hooks(model)


def test_plot_curves_writes_two_panels(tmp_path) -> None:
    model = make_tiny()
    frame = faithfulness.perplexity_curves(
        model, random_tokens(3, 8), ["attention", "random"], rates=(0.0, 0.5, 1.0), verbose=False
    )
    fig = viz.plot_curves(frame, tmp_path / "c.png", title="tiny")
    data = (tmp_path / "c.png").read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) < 300_000
    assert len(fig.axes) == 2 and all(
        len(ax.get_lines()) == 2 + 1 for ax in fig.axes
    )  # 2 metrics + zero line
    assert all(ax.get_yscale() == "symlog" for ax in fig.axes)  # ΔPPL spans orders of magnitude
    viz.plot_curves(frame, tmp_path / "c.svg")
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    assert viz.plot_curves(frame, y="delta_nll").axes[0].get_yscale() == "linear"
    with pytest.raises(ValueError, match="yscale"):
        viz.plot_curves(frame, yscale="logit")
    with pytest.raises(ValueError, match=r"png or \.svg"):
        viz.plot_curves(frame, tmp_path / "c.pdf")


def test_plot_curves_draws_the_table() -> None:
    """The drawn lines and bands carry the table's numbers: x = rate, y = the column, band = ci_low..ci_high."""
    rows = []
    for mode in ("comprehensiveness", "sufficiency"):
        for m, metric in enumerate(("contribution", "random")):
            for r, rate in enumerate((0.5, 0.0, 0.9)):  # unsorted on purpose
                y = 10.0 * (m + 1) * rate + (0.25 if mode == "sufficiency" else 0.0) + r
                row = {"metric": metric, "mode": mode, "rate": rate, "delta_ppl": y, "delta_nll": -y}
                rows.append({**row, "ci_low": y - 0.5 - r, "ci_high": y + 1.0 + r})
    frame = pd.DataFrame(rows)
    for column in ("delta_ppl", "delta_nll"):
        fig = viz.plot_curves(frame, y=column)
        for ax, mode in zip(fig.axes, ("comprehensiveness", "sufficiency"), strict=True):
            assert ax.get_title().startswith(mode)
            lines = [ln for ln in ax.get_lines() if ln.get_label() in ("contribution", "random")]
            assert [ln.get_label() for ln in lines] == ["contribution", "random"]
            assert len(ax.collections) == 2
            for line, band, metric in zip(lines, ax.collections, ("contribution", "random"), strict=True):
                want = frame[(frame["mode"] == mode) & (frame["metric"] == metric)].sort_values("rate")
                np.testing.assert_allclose(line.get_xdata(), want["rate"].to_numpy())
                np.testing.assert_allclose(line.get_ydata(), want[column].to_numpy())
                verts = {tuple(np.round(v, 9)) for v in band.get_paths()[0].vertices}
                for rate, lo, hi in zip(want["rate"], want["ci_low"], want["ci_high"], strict=True):
                    assert (round(rate, 9), round(lo, 9)) in verts and (round(rate, 9), round(hi, 9)) in verts
                ys = band.get_paths()[0].vertices[:, 1]
                assert ys.min() == pytest.approx(want["ci_low"].min())
                assert ys.max() == pytest.approx(want["ci_high"].max())
            assert [ln.get_ydata()[0] for ln in ax.get_lines() if ln not in lines] == [0]  # the zero line
