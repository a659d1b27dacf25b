"""Metrics after a ``hook_z`` intervention (``docs/definitions.md`` §2.6), against a float64
brute force written here from a plain ``run_with_cache`` of the patched pass.

The reference never uses mechgeom's helpers: GQA is mapped by ``h // group``, the modified heads are the
ones the test patched, and every quantity is an explicit sum over ``[q, k, d_model]``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny, random_tokens

from mechgeom.analyses.contribution.weights import (
    ContributionCollector,
    contribution_weights,
    contribution_weights_from_cache,
)
from mechgeom.analyses.heads import head_stats
from mechgeom.analyses.heads.pruning import head_ablation_hooks
from mechgeom.hooks import LayerCollector, has_hooks, modified_mask

# every test runs on the fused and the plain-torch sweep (conftest.sweep_path)
pytestmark = pytest.mark.usefixtures("sweep_path")

LAYER, HEAD = 1, 2


def _zero_head(z, hook, head=HEAD):
    z = z.clone()
    z[:, :, head] = 0.0  # z: [batch pos head d_head]
    return z


def _mean_head(z, hook, head=HEAD, fill=None):
    z = z.clone()
    z[:, :, head] = fill
    return z


def _patch_from(z, hook, head=HEAD, source=None):
    z = z.clone()
    z[:, :, head] = source[:, :, head]  # another run's z of the same head
    return z


def _reference(model, tokens, hooks, modified_heads):
    """Float64 brute force over the activations of the patched pass (as TransformerLens cached them)."""
    with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        _, cache = model.run_with_cache(tokens)
    cfg = model.cfg
    n_h = cfg.n_heads
    group = n_h // (cfg.n_key_value_heads or n_h)
    alpha = cache[f"blocks.{LAYER}.attn.hook_pattern"].double()  # [b h q k]
    v_kv = cache[f"blocks.{LAYER}.attn.hook_v"].double()  # [b k kv d]
    z = cache[f"blocks.{LAYER}.attn.hook_z"].double()  # [b q h d]
    W_O = model.W_O[LAYER].detach().double()
    B, _, Q, K = alpha.shape
    o_h = torch.einsum("bqhd,hdm->bqhm", z, W_O)
    o = o_h.sum(2)  # [b q m]: every head's actual output counts
    share = torch.zeros(B, n_h, Q, K, dtype=torch.float64)
    contrib = torch.full((B, n_h, Q, K), float("nan"), dtype=torch.float64)
    mod_share = torch.zeros(B, n_h, Q, dtype=torch.float64)
    vwi_vec = torch.zeros(B, Q, K, W_O.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(n_h):
            vt = v_kv[b, :, h // group] @ W_O[h]  # [k m]
            T = alpha[b, h][:, :, None] * vt[None]  # [q k m]
            for i in range(Q):
                if h in modified_heads:
                    mod_share[b, h, i] = (o[b, i] @ o_h[b, i, h]) / (o[b, i] @ o[b, i])
                    continue
                share[b, h, i] = (T[i] @ o[b, i]) / (o[b, i] @ o[b, i])
                contrib[b, h, i] = (T[i] @ o_h[b, i, h]) / (o_h[b, i, h] @ o_h[b, i, h])
                vwi_vec[b, i] += T[i]
    causal = torch.ones(Q, K, dtype=torch.bool).tril()
    contrib = torch.where(causal, contrib, torch.zeros_like(contrib))
    return {
        "head_share": share,
        "contribution": contrib,
        "contribution_inter": share.sum(1),
        "value_weighted_inter": vwi_vec.norm(dim=-1),
        "modified_share": mod_share,
        "pattern": alpha,
        "cache": cache,
    }


def _interventions(model, tokens):
    """(name, hooks, expected modified heads of LAYER) for the three kinds of hook_z change."""
    stats = head_stats(model, random_tokens(4, 9, seed=31))
    other = random_tokens(tokens.shape[0], tokens.shape[1], seed=32)
    _, other_cache = model.run_with_cache(other)
    src = other_cache[f"blocks.{LAYER}.attn.hook_z"]
    name = f"blocks.{LAYER}.attn.hook_z"
    return [
        ("zero (plain hook)", [(name, _zero_head)]),
        ("zero (head_ablation_hooks)", head_ablation_hooks(model, [(LAYER, HEAD)])),
        ("mean (plain hook)", [(name, lambda z, hook: _mean_head(z, hook, fill=stats.z_mean[LAYER, HEAD]))]),
        ("patch from another run", [(name, lambda z, hook: _patch_from(z, hook, source=src))]),
    ]


@pytest.mark.parametrize("kind", range(4), ids=["zero", "zero_lib", "mean", "patch"])
@pytest.mark.parametrize("n_kv", [None, 2], ids=["mha", "gqa"])
def test_metrics_after_hook_z_intervention_match_brute_force(kind: int, n_kv: int | None) -> None:
    model = make_tiny(n_kv=n_kv, seed=21)
    tokens = random_tokens(2, 9, seed=22)
    label, hooks = _interventions(model, tokens)[kind]
    ref = _reference(model, tokens, hooks, {HEAD})
    col = ContributionCollector(model, [LAYER])
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=[*hooks, *col.fwd_hooks])
    assert not has_hooks(model)
    res = col.result(tokens)
    # which heads were modified: exactly the patched one, at every query
    expected = torch.zeros(2, model.cfg.n_heads, 9, dtype=torch.bool)
    expected[:, HEAD] = True
    assert torch.equal(res.modified[:, 0], expected), label
    assert res.modified_heads == [(LAYER, HEAD)]
    got = {k: res.intra[k][:, 0].double() for k in ("head_share", "contribution")}
    got["contribution_inter"] = res.inter["contribution"][:, 0].double()
    got["value_weighted_inter"] = res.inter["value_weighted"][:, 0].double()
    got["modified_share"] = res.modified_share[:, 0].double()
    for key, val in got.items():
        torch.testing.assert_close(val, ref[key], atol=2e-5, rtol=1e-4, equal_nan=True, msg=f"{label}: {key}")
    # raw attention is still what the model computed; every other per-source metric of the head is NaN
    assert torch.equal(res.intra["attention"][:, 0], ref["pattern"].float())
    tril = torch.ones(9, 9, dtype=torch.bool).tril()
    for name in (
        "value_weighted",
        "value_weighted_normalized",
        "contribution",
        "factor_norm_ratio",
        "factor_cos",
    ):
        row = res.intra[name][:, 0, HEAD]
        assert row[:, tril].isnan().all(), name
        assert (row[:, ~tril] == 0).all(), name
    # the identities of docs/definitions.md §2.6 hold again
    total = res.inter["contribution"][:, 0].sum(-1) + res.modified_share[:, 0].sum(1)
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)
    total_h = res.intra["head_share"][:, 0].sum((1, 3)) + res.modified_share[:, 0].sum(1)
    torch.testing.assert_close(total_h, torch.ones_like(total_h), atol=1e-5, rtol=0)
    if kind < 2:  # a zeroed head: its part and its per-source shares are exactly 0
        assert (res.modified_share[:, 0, HEAD] == 0).all()
        assert (res.intra["head_share"][:, 0, HEAD] == 0).all()
        sums = res.inter["contribution"][:, 0].sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)
    else:
        assert (res.modified_share[:, 0, HEAD].abs() > 1e-6).any()
    # the cache path sees the same activations and marks the same heads
    from_cache = contribution_weights_from_cache(model, ref["cache"], layers=[LAYER], tokens=tokens)
    assert torch.equal(from_cache.modified, res.modified)
    torch.testing.assert_close(
        from_cache.inter["contribution"], res.inter["contribution"], atol=1e-6, rtol=0, equal_nan=True
    )
    frame = res.to_frame(heads=[HEAD], query=5)
    assert frame["modified"].all() and frame["contribution"].isna().all()


def test_clean_pass_marks_nothing_and_keeps_the_old_identities() -> None:
    for seed, n_kv in ((0, None), (1, 2), (2, 1)):
        model = make_tiny(n_kv=n_kv, seed=seed)
        res = contribution_weights(model, random_tokens(3, 12, seed=seed))
        assert not res.modified.any() and res.modified_heads == []
        assert (res.modified_share == 0).all()
        sums = res.inter["contribution"].sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)


def test_issue_reproducer_sums_with_head_ablation_hooks() -> None:
    model = make_tiny(n_layers=3, n_heads=6, n_kv=3, seed=5)
    tokens = random_tokens(2, 11, seed=6)
    res = contribution_weights(model, tokens, layers=[2], extra_hooks=head_ablation_hooks(model, [(2, 4)]))
    sums = res.inter["contribution"][:, 0].sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)
    assert (res.intra["head_share"][:, 0, 4] == 0).all()
    assert res.modified_heads == [(2, 4)]


def test_modified_mask_against_loops_and_tolerance() -> None:
    g = torch.Generator().manual_seed(3)
    alpha = torch.softmax(torch.randn(2, 3, 5, 5, generator=g), -1).double()
    v = torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64)
    z = torch.einsum("bhqk,bkhd->bqhd", alpha, v)
    assert not modified_mask(alpha, v, z).any()
    z2 = z.clone()
    z2[1, 3, 2] += 1e-3  # one (batch, query, head) changed
    z2[0, 0, 0] *= 1 + 1e-12  # rounding-size change: not an intervention
    m = modified_mask(alpha, v, z2)
    expected = torch.zeros(2, 3, 5, dtype=torch.bool)
    expected[1, 2, 3] = True
    assert torch.equal(m, expected)
    # float32 rounding of the same sum is not flagged; the reader agrees on a tiny model
    assert not modified_mask(alpha.float(), v.float(), z.float()).any()
    model = make_tiny(n_kv=2, seed=9)
    col = LayerCollector(model)
    with torch.no_grad():
        model.run_with_hooks(random_tokens(2, 10), fwd_hooks=col.fwd_hooks)
    assert all(not acts.any_modified for acts in col.captured.values())


def test_sinks_selection_and_taxonomy_mark_the_modified_head() -> None:
    from mechgeom.analyses.heads.taxonomy import classify_heads
    from mechgeom.analyses.selection.collector import token_selection
    from mechgeom.analyses.sinks.statistics import sink_statistics

    model = make_tiny(n_kv=2, seed=23)
    tokens = random_tokens(2, 10, seed=24)
    hooks = [(f"blocks.{LAYER}.attn.hook_z", _zero_head)]
    clean_sinks = sink_statistics(model, tokens)
    sinks = sink_statistics(model, tokens, extra_hooks=hooks)
    sel = token_selection(model, tokens, ns=[1, 2], n_random=0, extra_hooks=hooks)
    tax = classify_heads(model, tokens, extra_hooks=hooks)
    for res in (sinks, sel, tax):
        assert res.modified_heads == [(LAYER, HEAD)], type(res).__name__
        frame = res.to_frame()
        flagged = frame.loc[frame["modified"], ["layer", "head"]].drop_duplicates()
        assert flagged.values.tolist() == [[LAYER, HEAD]], type(res).__name__
    assert not clean_sinks.modified.any()
    assert (
        sinks.modified[:, 1, HEAD].all() and sinks.query_frame(layers=[LAYER], heads=[HEAD])["modified"].all()
    )
    assert not sinks.query_frame(layers=[0])["modified"].any()
    # pattern and value statistics are what the model computed: the same as without the hook in that layer
    torch.testing.assert_close(sinks.sink_rate, clean_sinks.sink_rate)
    # the taxonomy leaves the modified head's output alignments out and counts its queries
    li = tax.layers.index(LAYER)
    assert tax.sums["n_modified"][li, HEAD] == 2 * 9
    assert tax.sums["cos_sink_n"][li, HEAD] == 0 and tax.sums["cos_cur_n"][li, HEAD] == 0
    assert (tax.sums["n_modified"].sum() == 2 * 9) and (tax.sums["cos_sink_n"][li, HEAD - 1] > 0)


def test_causal_blocked_modified_mask_equals_the_full_product() -> None:
    # a causal pattern (0 above the diagonal), more queries than one block: the blocked product skips
    # only keys the queries cannot see, so it flags exactly what the full product flags
    g = torch.Generator().manual_seed(4)
    q = 37
    scores = torch.randn(2, 3, q, q, generator=g, dtype=torch.float64)
    alpha = torch.softmax(scores.masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), -torch.inf), -1)
    v = torch.randn(2, q, 3, 4, generator=g, dtype=torch.float64)
    z = torch.einsum("bhqk,bkhd->bqhd", alpha, v)
    z[0, 20, 1] += 1e-3
    z[1, 36, 2] = 0.0
    full = modified_mask(alpha, v, z)
    for block in (1, 8, 16, 64):
        assert torch.equal(modified_mask(alpha, v, z, causal=True, block_size=block), full)
    assert full.sum() == 2 and full[0, 1, 20] and full[1, 2, 36]
    # weight above the diagonal (not a decoder's pattern) is not read by the causal product: flagged
    alpha2 = alpha.clone()
    alpha2[0, 0, 3, 10] = 0.5
    z2 = torch.einsum("bhqk,bkhd->bqhd", alpha2, v)
    assert not modified_mask(alpha2, v, z2).any()
    assert modified_mask(alpha2, v, z2, causal=True, block_size=8)[0, 0, 3]
