"""Attention rollout against a brute force built from its definition (Abnar and Zuidema 2020).

The reference loops over texts and layers with plain matrices: ``A = 0.5 * mean_h alpha + 0.5 * I``, rows divided
by their sums, ``R_l = A_l @ R_{l-1}`` from ``R_{-1} = I``, and the score of layer ``l`` is ``R_{l-1}``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny, random_tokens
from refs import brute_rollout, patterns_of

import mechgeom
from mechgeom import attention_rollout
from mechgeom.analyses.attribution import RolloutCollector, rollout_step
from mechgeom.hooks import has_hooks


@pytest.mark.parametrize("n_kv", [None, 2])
def test_rollout_matches_the_brute_force(n_kv: int | None) -> None:
    model = make_tiny(n_layers=3, n_kv=n_kv, seed=11)
    tokens = random_tokens(3, 7, seed=2)
    res = attention_rollout(model, tokens, batch_size=2)
    pats = patterns_of(model, tokens)
    assert res.layers == [0, 1, 2] and tuple(res.scores.shape) == (3, 3, 7, 7)
    for b in range(3):
        for li, layer in enumerate(res.layers):
            torch.testing.assert_close(
                res.scores[b, li].double(), brute_rollout(pats, layer, b), atol=1e-6, rtol=0
            )
    torch.testing.assert_close(res.scores.sum(-1), torch.ones(3, 3, 7))  # rows sum to 1
    assert torch.equal(res.scores[:, 0], torch.eye(7).expand(3, 7, 7))  # layer 0 reads its own token only
    assert (res.scores.triu(1) == 0).all()  # a decoder's sources come before the query
    assert not has_hooks(model)


def test_a_subset_of_layers_and_the_cache_give_the_same_scores() -> None:
    model = make_tiny(n_layers=3, seed=4)
    tokens = random_tokens(2, 6, seed=5)
    full = attention_rollout(model, tokens)
    part = attention_rollout(model, tokens, layers=[2, 1])
    assert part.layers == [2, 1]
    torch.testing.assert_close(part.scores, full.scores[:, [2, 1]])
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(attention_rollout(model, tokens, cache=cache).scores, full.scores)


def test_a_pattern_intervention_changes_rollout_and_a_z_patch_is_marked() -> None:
    model = make_tiny(n_layers=3, seed=6)
    tokens = random_tokens(2, 6, seed=1)
    fix = torch.zeros(6, 6)
    fix[:, 0] = 1.0  # every query of layer 0 attends to the first token only

    def to_first(pattern, hook):
        return fix.expand_as(pattern).clone()

    edit = [("blocks.0.attn.hook_pattern", to_first)]
    res = attention_rollout(model, tokens, layers=[1, 2], extra_hooks=edit)
    pats = patterns_of(model, tokens, edit)
    for b in range(2):
        torch.testing.assert_close(res.scores[b, 0].double(), brute_rollout(pats, 1, b), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        res.scores[:, 0, :, 0], torch.full((2, 6), 0.5).index_fill(1, torch.tensor([0]), 1.0)
    )
    # a z patch in layer 1 changes only the patterns of layer 2 and above: rollout up to layer 2 reads none
    ablated = attention_rollout(model, tokens, extra_hooks=mechgeom.head_ablation_hooks(model, [(1, 1)]))
    torch.testing.assert_close(ablated.scores, attention_rollout(model, tokens).scores)
    assert ablated.modified_heads == [(1, 1)]  # the result says which head was changed
    assert attention_rollout(model, tokens).modified_heads == []


def test_an_encoders_padding_gets_no_share() -> None:
    """Padding (found by the tokenizer's pad id) is masked out of every key: it gets no share, its rows are 0,
    and the real rows equal the same text run alone."""
    model = make_tiny(n_layers=2, seed=3, attention_dir="bidirectional")
    model.tokenizer = type(  # a real encoder's tokenizer carries the pad id; the strings are the ids
        "Tok",
        (),
        {
            "pad_token_id": 0,
            "batch_decode": lambda self, ids, **kw: [f"<{i}>" for i in ids],
            "convert_ids_to_tokens": lambda self, ids: [f"<{int(i)}>" for i in ids],
        },
    )()
    tokens = random_tokens(2, 6, seed=7).clamp_min(1)
    tokens[1, 4:] = 0
    res = attention_rollout(model, tokens)
    assert (res.scores[1, :, 4:] == 0).all() and (res.scores[1, :, :, 4:] == 0).all()
    torch.testing.assert_close(res.scores[1, :, :4].sum(-1), torch.ones(2, 4))
    alone = attention_rollout(model, tokens[1:, :4])
    torch.testing.assert_close(res.scores[1, :, :4, :4], alone.scores[0], atol=1e-6, rtol=1e-5)
    assert not res.causal and len(res.to_frame(batch=1)) == 2 * 16  # real pairs only


def test_rollout_step_keeps_rows_stochastic() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.rand(2, 3, 5, 5, generator=g).tril()
    p = p / p.sum(-1, keepdim=True)
    r = rollout_step(p, rollout_step(p, None))
    torch.testing.assert_close(r.sum(-1), torch.ones(2, 5))


def test_table_and_summary() -> None:
    model = make_tiny(n_layers=2, seed=2)
    res = attention_rollout(model, random_tokens(2, 5, seed=3), layers=1)
    frame = res.to_frame()
    assert len(frame) == 2 * 15 and list(frame.columns[:4]) == ["batch", "layer", "query", "key"]
    assert frame.groupby(["batch", "query"])["rollout"].sum().round(5).eq(1).all()
    s = res.summary()
    assert s["layers"] == [1] and 0 < s["first_token_share"][0] < 1 and 0 < s["self_share"][0] <= 1


def test_the_collector_reads_every_layer_below() -> None:
    model = make_tiny(n_layers=3, seed=1)
    assert RolloutCollector(model, [1]).layers == [0, 1]
    assert RolloutCollector(model, [0]).layers == [0]


@pytest.mark.parametrize("scope", ["inter", "intra"])
def test_rollout_ranks_sources_in_the_masking_harness(scope: str) -> None:
    """As a ranking method, rollout ranks each query's sources by its scores (one ranking for every head), so
    the harness removes exactly the sources a brute-force ranking of the brute-force scores names."""
    from mechgeom.analyses import faithfulness
    from mechgeom.hooks import rank_sources

    model = make_tiny(n_layers=3, n_kv=2, seed=21)
    tokens = random_tokens(2, 8, seed=22)
    ranking = faithfulness.source_rankings(model, tokens, metrics=["rollout"], scope=scope)["rollout"]
    pats = patterns_of(model, tokens)
    for layer in range(3):
        ranks = ranking.ranks[layer]
        assert ranks.shape[1] == (1 if scope == "inter" else model.cfg.n_heads)
        for b in range(2):
            want = rank_sources(brute_rollout(pats, layer, b).float())
            for h in range(ranks.shape[1]):
                assert torch.equal(ranks[b, h].long().tril(), want.long().tril()), (layer, b, h)
    curves = faithfulness.perplexity_curves(
        model, tokens, metrics=["rollout", "random"], rates=(0.0, 0.5), scope=scope, batch_size=1
    )
    assert set(curves["metric"]) == {"rollout", "random"}
    assert (curves.loc[curves["rate"] == 0, "delta_ppl"] == 0).all()
    assert not has_hooks(model)
