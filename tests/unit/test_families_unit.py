"""The family matrix (issue 36, point 1): every analysis on a tiny random model of each of the papers'
families (``tests/families.py``), against the brute-force references of ``tests/unit``.

TransformerLens 3.x builds each family as a ``HookedTransformer``, 4.x as a ``TransformerBridge`` around a
random Hugging Face model of the family's ``transformers`` config; a family that cannot be built on the
installed line is skipped with the reason.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from families import BOS, FAMILIES, N_HEADS, N_LAYERS, WINDOW, FamilyUnavailable, build, tokens
from reference_contribution import acts_of, assert_all_metrics_match, brute_force
from refs import (
    brute_rollout,
    brute_winners,
    check_selection,
    check_sink_statistics,
    patterns_of,
    sink_reference,
)

from mechgeom import attention_rollout
from mechgeom.analyses import faithfulness
from mechgeom.analyses.contribution.weights import (
    INTER_METRICS,
    INTRA_METRICS,
    contribution_weights,
    reconstruct_attn_out,
)
from mechgeom.analyses.heads.stats import head_stats
from mechgeom.analyses.heads.taxonomy import classify_heads
from mechgeom.analyses.selection import token_selection
from mechgeom.analyses.sinks import sink_statistics
from mechgeom.hooks import MODES, LayerCollector, expand_kv, has_hooks, masking_hooks, run_hooks

POS = 12


@functools.cache
def _model(family: str) -> Any:
    try:
        return build(family, seed=0)
    except FamilyUnavailable as exc:
        return exc


def family_model(family: str) -> Any:
    """The family's model, built once per session; skips the test with the reason where it cannot be."""
    model = _model(family)
    if isinstance(model, FamilyUnavailable):
        pytest.skip(f"{family}: {model}")
    return model


@functools.cache
def _cache(family: str) -> Any:
    model = family_model(family)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(family, pos=POS))
    return cache


def cache_of(family: str) -> Any:
    """``run_with_cache`` of the family's model on :func:`families.tokens`, once per session."""
    family_model(family)
    return _cache(family)


fams = pytest.mark.parametrize("family", list(FAMILIES))
#: The families with sliding-window layers.
local_fams = pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f].local_layers])


# --------------------------------------------------------------------------- the families themselves


@fams
def test_the_family_features_are_in_the_model(family: str) -> None:
    """The matrix cannot silently lose what makes each family: its query/key biases are nonzero exactly
    where it has them, its KV heads, soft caps, and (on text) the BOS Gemma needs."""
    model, fam = family_model(family), FAMILIES[family]
    cfg = model.cfg
    assert (cfg.n_key_value_heads or cfg.n_heads) == fam.n_kv
    for layer in range(N_LAYERS):
        attn = model.blocks[layer].attn
        for name in ("b_Q", "b_K"):  # b_V may be folded into b_O (the value-bias convention; not here)
            bias = getattr(attn, name, None)
            has = isinstance(bias, torch.Tensor) and float(bias.detach().abs().max()) > 0.05
            assert has == (fam.biases != "none"), (layer, name)
    caps = (float(cfg.attn_scores_soft_cap), float(cfg.output_logits_soft_cap))
    assert caps == ((5.0, 3.0) if family == "gemma2" else (-1.0, -1.0))
    res = contribution_weights(model, "t5 t6 t7 t8")
    if family.startswith("gemma"):
        assert res.tokens[0, 0].item() == BOS  # Gemma reads nothing sensible without its BOS
    ids = res.tokens[0, -4:].tolist()
    assert ids == [5, 6, 7, 8]
    by_ids = contribution_weights(model, res.tokens)
    for name in INTRA_METRICS:
        torch.testing.assert_close(res.intra[name], by_ids.intra[name], equal_nan=True)


# --------------------------------------------------------------------------- contribution weights


@fams
def test_contribution_matches_the_materialised_reference(family: str) -> None:
    model, cache = family_model(family), cache_of(family)
    res = contribution_weights(model, tokens(family, pos=POS))
    for li, layer in enumerate(res.layers):
        alpha, v, z = (t[:1] for t in acts_of(cache, layer))  # the loop reference on the first text
        W_O = model.W_O[layer]
        window = (
            WINDOW if layer in FAMILIES[family].local_layers else None
        )  # the sources the model lets it see
        ref = brute_force(alpha, v, W_O, window=window)
        # the materialisation is the model's own: its head outputs are z @ W_O
        torch.testing.assert_close(
            ref["o_head"], torch.einsum("bqhd,hdm->bqhm", z.double(), W_O.double()), atol=1e-5, rtol=1e-5
        )
        assert_all_metrics_match(
            {k: t[:1, li] for k, t in res.intra.items()}, {k: t[:1, li] for k, t in res.inter.items()}, ref
        )
    c = res.intra["contribution"]
    torch.testing.assert_close(c.sum(-1), torch.ones_like(c[..., 0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        res.inter["contribution"].sum(-1), torch.ones_like(c[:, :, 0, :, 0]), atol=1e-4, rtol=0
    )
    assert (c < 0).any()  # not degenerate: some sources point against the output


@fams
def test_reconstruction_reproduces_hook_attn_out(family: str) -> None:
    """``sum_h sum_j alpha v_j W_O + b_O`` is ``hook_attn_out``: where soft-capping, QK-norm, local windows,
    biases or parallel attention made the readers' activations differ from the attention the model ran,
    this is where it shows."""
    model = family_model(family)
    col = LayerCollector(model)
    with model.hooks(fwd_hooks=col.fwd_hooks, reset_hooks_end=True):
        _, cache = model.run_with_cache(
            tokens(family, pos=POS), names_filter=lambda n: n.endswith("hook_attn_out")
        )
    assert not has_hooks(model)
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(
            reconstruct_attn_out(model, col.captured[layer]),
            cache[f"blocks.{layer}.hook_attn_out"],
            atol=1e-5,
            rtol=1e-5,
        )


FACTORS = ("factor_norm_ratio", "factor_cos")  # not weighted by alpha: 0 outside a window by the source rule


@fams
def test_local_layers_attend_within_their_window_and_so_do_the_metrics(family: str) -> None:
    model, cache = family_model(family), cache_of(family)
    res = contribution_weights(model, tokens(family, pos=POS))
    outside = torch.ones(POS, POS, dtype=torch.bool).tril(-WINDOW)  # j <= i - WINDOW
    for li, layer in enumerate(res.layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        if layer in FAMILIES[family].local_layers:
            assert (pattern[..., outside] == 0).all(), f"layer {layer} attends outside its window"
            for name in INTRA_METRICS:
                if name not in FACTORS:
                    assert (res.intra[name][:, li][..., outside] == 0).all(), name
            for name in INTER_METRICS:
                assert (res.inter[name][:, li][..., outside] == 0).all(), name
        else:  # a global layer: the window test above is not vacuous
            assert (pattern[..., outside] > 1e-3).any(), f"layer {layer} is global"


@local_fams
def test_factors_are_zero_outside_a_local_window(family: str) -> None:
    """The keys a sliding window hides are not sources (docs/definitions.md §1.1): the alpha-free factors are 0
    there too, on the full sweep and on the kept rows of ``queries=``; inside the window they are untouched."""
    model = family_model(family)
    toks = tokens(family, pos=POS)
    res = contribution_weights(model, toks)
    last = contribution_weights(model, toks, queries=[-1])
    outside = torch.ones(POS, POS, dtype=torch.bool).tril(-WINDOW)
    inside = torch.ones(POS, POS, dtype=torch.bool).tril() & ~outside
    for li, layer in enumerate(res.layers):
        local = layer in FAMILIES[family].local_layers
        for name in FACTORS:
            full = res.intra[name][:, li]
            assert (full[..., outside] == 0).all() == local, (name, layer)
            assert (full[..., inside] != 0).any(), (name, layer)
            torch.testing.assert_close(last.intra[name][:, li, :, 0], full[:, :, -1], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the other analyses

SINKS = [0]


@fams
def test_sink_statistics_match_the_loop_reference(family: str) -> None:
    model = family_model(family)
    toks = tokens(family, pos=9)[:1]
    res = sink_statistics(model, toks, sink_positions=SINKS, batch_size=1)
    ref = sink_reference(model, toks, SINKS)
    check_sink_statistics(
        res, ref, n_layers=N_LAYERS, n_heads=N_HEADS, n_texts=1, pos=9, sinks=SINKS, massless_norm=False
    )


@local_fams
def test_head_out_norm_is_finite_where_a_window_hides_the_sink(family: str) -> None:
    model, cache = family_model(family), cache_of(family)
    res = sink_statistics(model, tokens(family, pos=POS), sink_positions=SINKS, batch_size=1)
    for layer in FAMILIES[family].local_layers:
        z, W_O = cache[f"blocks.{layer}.attn.hook_z"], model.W_O[layer]
        want = torch.einsum("bqhd,hdm->bhqm", z, W_O).norm(dim=-1)[..., 1:]
        got = res.head_out_norm()[:, layer, :, 1:].float()
        seen = res.sink_mass[:, layer, :, 1:] > 0  # the queries the sink is within reach of agree already
        torch.testing.assert_close(got[seen], want[seen], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@fams
def test_token_selection_matches_the_brute_force(family: str) -> None:
    model, cache = family_model(family), cache_of(family)
    ns = [1, 2, 5]
    res = token_selection(
        model, tokens(family, pos=POS)[:1], ns=ns, sink_positions=SINKS, n_random=0, dtype=torch.float64
    )
    assert res.queries == list(range(POS))
    for li, layer in enumerate(res.layers):
        pat = cache[f"blocks.{layer}.attn.hook_pattern"][:1].double()
        v = expand_kv(cache[f"blocks.{layer}.attn.hook_v"][:1], N_HEADS).double()
        check_selection({k: t[:, li] for k, t in res.per_query.items()}, pat, v, ns, tuple(SINKS))


@fams
def test_taxonomy_winners_match_the_brute_force(family: str) -> None:
    model, cache = family_model(family), cache_of(family)
    res = classify_heads(model, tokens(family, pos=POS), keep_winners=True)
    assert res.winners is not None
    for li, layer in enumerate(res.layers):
        pat = cache[f"blocks.{layer}.attn.hook_pattern"]
        v = expand_kv(cache[f"blocks.{layer}.attn.hook_v"], N_HEADS)
        want = torch.tensor(brute_winners(pat, v))
        assert torch.equal(res.winners[:, li, :, 1:], want[..., 1:])


@fams
def test_head_stats_match_loops(family: str) -> None:
    model, cache = family_model(family), cache_of(family)
    stats = head_stats(model, tokens(family, pos=POS), taxonomy=False)
    assert stats.n_positions == 2 * POS
    for layer in range(N_LAYERS):
        z = cache[f"blocks.{layer}.attn.hook_z"].double()
        pat = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        W_O = model.W_O[layer].detach().double()
        for h in range(N_HEADS):
            rows = [(b, i) for b in range(2) for i in range(POS)]
            norms = [float((z[b, i, h] @ W_O[h]).norm()) for b, i in rows]
            ents = [-sum(float(a * a.log()) for a in pat[b, h, i] if a > 0) for b, i in rows]
            zs = torch.stack([z[b, i, h] for b, i in rows])
            assert float(stats.out_norm[layer, h]) == pytest.approx(sum(norms) / len(rows), rel=1e-5)
            assert float(stats.entropy[layer, h]) == pytest.approx(sum(ents) / len(rows), rel=1e-4, abs=1e-6)
            torch.testing.assert_close(stats.z_mean[layer, h].double(), zs.mean(0), atol=1e-6, rtol=1e-5)


@fams
def test_rollout_matches_the_brute_force(family: str) -> None:
    model = family_model(family)
    toks = tokens(family, pos=POS)
    res = attention_rollout(model, toks)
    pats = patterns_of(model, toks)
    for b in range(2):
        for li, layer in enumerate(res.layers):
            torch.testing.assert_close(
                res.scores[b, li].double(), brute_rollout(pats, layer, b), atol=1e-6, rtol=0
            )


@fams
def test_masking_at_rate_zero_changes_nothing_and_at_one_half_does(family: str) -> None:
    model = family_model(family)
    toks = tokens(family, pos=POS)
    clean = run_hooks(model, toks, [], return_type="logits")
    ranking = faithfulness.source_rankings(model, toks, ["contribution"])["contribution"]
    for mode in MODES:
        zero = masking_hooks(model, ranking=ranking, rate=0.0, mode=mode)
        assert torch.equal(run_hooks(model, toks, zero, return_type="logits"), clean), mode
        half = masking_hooks(model, ranking=ranking, rate=0.5, mode=mode)
        assert not torch.allclose(run_hooks(model, toks, half, return_type="logits"), clean, atol=1e-4), mode
    assert not has_hooks(model)
