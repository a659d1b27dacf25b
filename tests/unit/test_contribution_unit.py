"""Contribution weights (``docs/definitions.md`` §2) against the brute-force reference of ``tests/reference_contribution.py``
(explicit ``[q, k, d_model]`` materialisation per head) on tiny random models, plus properties and composition."""

from __future__ import annotations

import weakref
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny, needs_hooked, random_tokens
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from reference_contribution import acts_of, assert_all_metrics_match, brute_force
from transformer_lens.patching import layer_head_pattern_patch_setter, layer_head_vector_patch_setter

from mechgeom.analyses.contribution import BLOCK_SIZE
from mechgeom.analyses.contribution.weights import (
    INTER_METRICS,
    INTRA_METRICS,
    ContributionCollector,
    LayerGeometry,
    contribution_weights,
    contribution_weights_from_cache,
    reconstruct_attn_out,
)
from mechgeom.hooks import LayerCollector, expand_kv, has_hooks, run_hooks

# every test runs on the fused and the plain-torch sweep (conftest.sweep_path)
pytestmark = pytest.mark.usefixtures("sweep_path")

TINY_CONFIGS = {
    "mha_bias": dict(),
    "gqa_bias": dict(n_kv=2),
    "mqa_bias": dict(n_kv=1),
    "attn_only_bias": dict(attn_only=True),
    "attn_only_gqa_nobias": dict(attn_only=True, n_kv=2, b_O=False),
}


# --------------------------------------------------------------------------- against the brute force


@pytest.mark.parametrize("cfg", list(TINY_CONFIGS), ids=list(TINY_CONFIGS))
def test_every_metric_matches_materialised_reference(cfg: str) -> None:
    model = make_tiny(**TINY_CONFIGS[cfg], seed=3)
    tokens = random_tokens(batch=2, pos=10, seed=4)
    res = contribution_weights(model, tokens)
    _, cache = model.run_with_cache(tokens)
    for li, layer in enumerate(res.layers):
        alpha, v, z = acts_of(cache, layer)
        ref = brute_force(alpha, v, model.W_O[layer])
        # the reference's head outputs are the model's own z @ W_O (so the materialisation is right)
        torch.testing.assert_close(
            ref["o_head"],
            torch.einsum("bqhd,hdm->bqhm", z.double(), model.W_O[layer].double()),
            atol=1e-5,
            rtol=0,
        )
        assert_all_metrics_match(
            {k: t[:, li] for k, t in res.intra.items()}, {k: t[:, li] for k, t in res.inter.items()}, ref
        )
        # the data are not degenerate: some contribution weights are negative, some exceed attention
        assert (res.intra["contribution"][:, li] < 0).any()


@pytest.mark.parametrize("block_size", [1, 3, 4, 128])
def test_layer_geometry_blocked_sweep_matches_reference_on_gqa(block_size: int) -> None:
    model = make_tiny(n_kv=2, seed=5)
    tokens = random_tokens(batch=2, pos=10, seed=6)
    _, cache = model.run_with_cache(tokens)
    alpha, v, z = acts_of(cache, 1)
    v_exp, W = expand_kv(v, model.cfg.n_heads), model.W_O[1].detach()
    ref = brute_force(alpha, v, W)
    intra, inter = LayerGeometry(alpha, v_exp, z, W, block_size=block_size).compute()
    assert_all_metrics_match(intra, inter, ref)
    geo = LayerGeometry(alpha, v_exp, z, W, block_size=block_size)
    assert_all_metrics_match(
        {n: geo.intra(n) for n in INTRA_METRICS}, {n: geo.inter(n) for n in INTER_METRICS}, ref
    )


def test_wo_gram_cache_follows_the_weights() -> None:
    model = make_tiny(n_kv=2, seed=5)
    tokens = random_tokens(batch=1, pos=6, seed=6)
    _, cache = model.run_with_cache(tokens)
    alpha, v, z = acts_of(cache, 0)
    v = expand_kv(v, 4)
    W = model.W_O[0].detach().clone()
    before = LayerGeometry(alpha, v, z, W)
    gram0, vw0, c0 = before.wo_gram_full.clone(), before.value_weighted(), before.contribution()
    with torch.no_grad():
        W.mul_(2.0)  # in place: same storage, new values
    after = LayerGeometry(alpha, v, z, W)
    torch.testing.assert_close(after.wo_gram_full, 4 * gram0)
    torch.testing.assert_close(after.value_weighted(), 2 * vw0)
    torch.testing.assert_close(after.contribution(), c0)  # c is scale-invariant in W_O


def test_sums_and_factorisation_on_two_layer_model() -> None:
    model = make_tiny(n_layers=2, n_kv=2, seed=7)
    res = contribution_weights(model, random_tokens(batch=3, pos=14, seed=8))
    c, share, c_inter = res.intra["contribution"], res.intra["head_share"], res.inter["contribution"]
    ones = torch.ones_like(c_inter[..., 0])
    torch.testing.assert_close(c.sum(-1), torch.ones_like(c[..., 0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(c_inter.sum(-1), ones, atol=1e-4, rtol=0)
    torch.testing.assert_close(share.sum((2, 4)), ones, atol=1e-4, rtol=0)
    torch.testing.assert_close(share.sum(2), c_inter, atol=1e-5, rtol=0)
    product = res.intra["attention"] * res.intra["factor_norm_ratio"] * res.intra["factor_cos"]
    torch.testing.assert_close(product, c, atol=1e-5, rtol=1e-5)
    # the key > query triangle of every metric, factors included, is 0
    upper = torch.ones(14, 14, dtype=torch.bool).triu(1)
    for name in INTRA_METRICS:
        assert (res.intra[name][..., upper] == 0).all(), name
    for name in INTER_METRICS:
        assert (res.inter[name][..., upper] == 0).all(), name


def test_reconstruct_attn_out_includes_b_O() -> None:
    for cfg in ({}, {"n_kv": 2}, {"attn_only": True}):
        model = make_tiny(**cfg, seed=9)
        tokens = random_tokens(batch=2, pos=11, seed=10)
        col = LayerCollector(model)
        with model.hooks(fwd_hooks=col.fwd_hooks, reset_hooks_end=True):
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_attn_out"))
        assert not has_hooks(model)
        for layer in range(model.cfg.n_layers):
            acts = col.captured[layer]
            assert acts.b_O.abs().max() > 0.1  # make_tiny's random b_O is really in play
            torch.testing.assert_close(
                reconstruct_attn_out(model, acts),
                cache[f"blocks.{layer}.hook_attn_out"],
                atol=1e-5,
                rtol=1e-5,
            )


# --------------------------------------------------------------------------- hypothesis properties


@st.composite
def layer_inputs(draw):
    """Random shapes, a causal softmax pattern with random sources removed (not renormalised)."""
    batch = draw(st.integers(1, 2))
    n_kv = draw(st.integers(1, 3))
    n_heads = n_kv * draw(st.integers(1, 3))
    pos = draw(st.integers(1, 8))
    d_head = draw(st.integers(1, 5))
    d_model = draw(st.integers(2, 9))
    drop = draw(st.sampled_from([0.0, 0.3, 0.7]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, n_heads, pos, pos, generator=g, dtype=torch.float64) * 3
    causal = torch.ones(pos, pos, dtype=torch.bool).tril()
    alpha = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    removed = torch.rand(alpha.shape, generator=g, dtype=torch.float64) < drop
    alpha = alpha.masked_fill(removed, 0.0)
    v_kv = torch.randn(batch, pos, n_kv, d_head, generator=g, dtype=torch.float64)
    W_O = torch.randn(n_heads, d_head, d_model, generator=g, dtype=torch.float64)
    block = draw(st.integers(1, 9))  # query blocks of the sweep: 1 (every row alone) .. whole
    return alpha, v_kv, W_O, block


def geometry_of(
    alpha: torch.Tensor, v_kv: torch.Tensor, W_O: torch.Tensor, block_size: int = 128
) -> LayerGeometry:
    v = expand_kv(v_kv, alpha.shape[1])
    z = torch.einsum("bhqk,bkhd->bqhd", alpha, v)  # z consistent with alpha and v
    return LayerGeometry(alpha, v, z, W_O, block_size=block_size)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_inputs())
def test_property_agrees_with_brute_force(inputs) -> None:
    alpha, v_kv, W_O, block = inputs
    geo = geometry_of(*inputs)
    ref = brute_force(alpha, v_kv, W_O)
    # exclude near-cancelling outputs (conditioning, not correctness): exact zeros are kept
    o_norm = ref["o_head"].norm(dim=-1)
    assume(bool(((o_norm == 0) | (o_norm > 1e-3)).all()))
    o_layer = ref["o_head"].sum(2).norm(dim=-1)
    assume(bool(((o_layer == 0) | (o_layer > 1e-3)).all()))
    # one sweep for the whole family, or one sweep per metric: the same numbers
    if block % 2:
        intra, inter = geo.compute()
    else:
        intra, inter = {n: geo.intra(n) for n in INTRA_METRICS}, {n: geo.inter(n) for n in INTER_METRICS}
    assert_all_metrics_match(intra, inter, ref)


@settings(max_examples=80, deadline=None)
@given(layer_inputs())
def test_property_sums_factors_nan_rows_and_ranking(inputs) -> None:
    alpha = inputs[0]
    geo = geometry_of(*inputs)
    dead_head_row = alpha.sum(-1) == 0  # [b h q]: every source removed -> o[i,h] = 0
    dead_layer_row = dead_head_row.all(1)  # [b q]
    c, share, c_inter = geo.contribution(), geo.head_share(), geo.contribution_inter()

    # NaN exactly in the zero-output rows, and only there
    pos = alpha.shape[-1]
    source = torch.ones(pos, pos, dtype=torch.bool).tril()  # j <= i
    for t in (c, geo.value_weighted_normalized(), geo.factor_norm_ratio(), geo.factor_cos()):
        assert torch.equal(t.isnan().any(-1), dead_head_row)
        dead = t[dead_head_row]  # [n, k]: the dead (b, h, i) rows
        q_idx = dead_head_row.nonzero()[:, 2]
        assert torch.equal(dead.isnan(), source[q_idx])  # NaN at every source, 0 above the diagonal
        assert (dead[~source[q_idx]] == 0).all()
    for t in (share.transpose(1, 2).flatten(2), c_inter, geo.value_weighted_normalized_inter()):
        assert torch.equal(t.isnan().any(-1), dead_layer_row)
    assert not geo.value_weighted().isnan().any() and not geo.value_weighted_inter().isnan().any()

    # sums to 1 on every live row
    live = ~dead_head_row
    torch.testing.assert_close(c.sum(-1)[live], torch.ones_like(c.sum(-1)[live]), atol=1e-9, rtol=0)
    live_l = ~dead_layer_row
    torch.testing.assert_close(
        c_inter.sum(-1)[live_l], torch.ones_like(c_inter.sum(-1)[live_l]), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(
        share.sum((1, 3))[live_l], torch.ones_like(share.sum((1, 3))[live_l]), atol=1e-9, rtol=0
    )

    # the factor identity c = alpha * (|vt|/|o|) * cos, NaN rows included
    torch.testing.assert_close(alpha * geo.factor_norm_ratio() * geo.factor_cos(), c, equal_nan=True)

    # per-query normalisation never reverses the order of two sources of the same query
    for raw, normed in (
        (geo.value_weighted(), geo.value_weighted_normalized()),
        (geo.value_weighted_inter(), geo.value_weighted_normalized_inter()),
    ):
        d_raw = raw[..., :, None] - raw[..., None, :]
        d_norm = normed[..., :, None] - normed[..., None, :]
        ok = d_norm.isnan() | (torch.sign(d_raw) * torch.sign(d_norm) >= 0)
        assert ok.all()


# --------------------------------------------------------------------------- zero output norm


def zero_row_hook(pattern: torch.Tensor, hook, *, heads: list[int], query: int) -> torch.Tensor:
    # pattern: [batch head q k]; remove every source of one query (no renormalisation)
    pattern = pattern.clone()
    pattern[:, heads, query, :] = 0.0
    return pattern


def test_zeroed_pattern_row_gives_nan_in_that_row_only() -> None:
    model = make_tiny(n_kv=2, seed=11)
    tokens = random_tokens(batch=2, pos=8, seed=12)
    hook = ("blocks.1.attn.hook_pattern", partial(zero_row_hook, heads=[2], query=5))
    res = contribution_weights(model, tokens, extra_hooks=[hook])
    assert not has_hooks(model)
    nan_rows = torch.zeros(2, 2, 4, 8, dtype=torch.bool)
    nan_rows[:, 1, 2, 5] = True
    for name in ("value_weighted_normalized", "contribution", "factor_norm_ratio", "factor_cos"):
        t = res.intra[name]
        assert t[:, 1, 2, 5, :6].isnan().all() and (t[:, 1, 2, 5, 6:] == 0).all(), name
        assert torch.equal(t.isnan().any(-1), nan_rows), name
    for name in ("attention", "value_weighted"):
        assert (res.intra[name][:, 1, 2, 5] == 0).all()
    # the layer output still has the other heads: inter metrics and head shares stay finite
    assert not res.intra["head_share"].isnan().any()
    for t in res.inter.values():
        assert not t.isnan().any()
    assert (res.intra["head_share"][:, 1, 2, 5] == 0).all()


def test_zeroed_row_in_every_head_gives_nan_in_inter_metrics() -> None:
    model = make_tiny(seed=13)
    tokens = random_tokens(batch=1, pos=7, seed=14)
    hook = ("blocks.0.attn.hook_pattern", partial(zero_row_hook, heads=[0, 1, 2, 3], query=3))
    res = contribution_weights(model, tokens, layers=[0], extra_hooks=[hook])
    expected = torch.zeros(1, 1, 7, dtype=torch.bool)
    expected[0, 0, 3] = True
    for name in ("value_weighted_normalized", "contribution"):
        assert torch.equal(res.inter[name].isnan().any(-1), expected), name
    assert torch.equal(res.intra["head_share"].isnan().any(-1).any(2), expected)
    assert not res.inter["value_weighted"].isnan().any() and not res.inter["attention"].isnan().any()


def test_cancelling_contributions_give_nan_not_inf() -> None:
    # one head, two sources with equal weight and opposite values: o = 0 although alpha != 0
    alpha = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])  # [1 1 2 2]
    v = torch.tensor([[[[1.0, 2.0]], [[-1.0, -2.0]]]])  # [1 2 1 2]
    W_O = torch.tensor([[[1.0, 0.0, 1.0], [0.0, 1.0, -1.0]]])  # [1 2 3]
    geo = geometry_of(alpha, v, W_O)
    assert geo.head_out_norm[0, 0, 1] == 0
    for t in (geo.contribution(), geo.value_weighted_normalized(), geo.factor_norm_ratio(), geo.factor_cos()):
        assert t[0, 0, 1].isnan().all() and t[0, 0, 0].isfinite().all()
    torch.testing.assert_close(geo.contribution()[0, 0, 0], torch.tensor([1.0, 0.0]))
    assert geo.value_weighted()[0, 0, 1].isfinite().all()
    assert geo.contribution_inter()[0, 1].isnan().all()


# --------------------------------------------------------------------------- composition with other hooks


def test_collector_composes_with_patching_hooks() -> None:
    model = make_tiny(n_kv=2, seed=15)
    clean, corrupted = random_tokens(2, 9, seed=16), random_tokens(2, 9, seed=17)
    _, clean_cache = model.run_with_cache(clean)

    def patching_hook(act, hook, index, clean_activation, setter):
        return setter(act.clone(), index, clean_activation)

    patches = [
        (
            "blocks.0.attn.hook_z",
            partial(
                patching_hook,
                index=[0, 1],
                clean_activation=clean_cache["blocks.0.attn.hook_z"],
                setter=layer_head_vector_patch_setter,
            ),
        ),
        # patch the very hook point the collector reads: it must see the patched pattern
        (
            "blocks.1.attn.hook_pattern",
            partial(
                patching_hook,
                index=[1, 3],
                clean_activation=clean_cache["blocks.1.attn.hook_pattern"],
                setter=layer_head_pattern_patch_setter,
            ),
        ),
    ]
    col = ContributionCollector(model)
    with torch.no_grad():
        logits_with = model.run_with_hooks(corrupted, fwd_hooks=[*patches, *col.fwd_hooks])
        logits_without = model.run_with_hooks(corrupted, fwd_hooks=patches)
    assert not has_hooks(model)
    assert torch.equal(logits_with, logits_without)
    res = col.result(corrupted)
    with model.hooks(fwd_hooks=patches, reset_hooks_end=True):
        _, patched_cache = model.run_with_cache(corrupted)
    ref = contribution_weights_from_cache(model, patched_cache, tokens=corrupted)
    for name in INTRA_METRICS:
        assert torch.equal(res.intra[name], ref.intra[name]) or torch.allclose(
            res.intra[name], ref.intra[name], atol=1e-6, equal_nan=True
        ), name
    for name in INTER_METRICS:
        torch.testing.assert_close(res.inter[name], ref.inter[name], atol=1e-6, rtol=0, equal_nan=True)
    # the patch really changed what the collector saw
    plain = contribution_weights(model, corrupted)
    assert not torch.allclose(plain.intra["contribution"][:, 1, 3], res.intra["contribution"][:, 1, 3])
    assert torch.equal(res.intra["attention"][:, 1, 3], clean_cache["blocks.1.attn.hook_pattern"][:, 3])


def test_hook_path_cache_path_context_manager_and_run_with_cache_agree() -> None:
    model = make_tiny(n_kv=1, seed=18)
    tokens = random_tokens(2, 10, seed=19)
    res = contribution_weights(model, tokens)
    _, cache = model.run_with_cache(tokens)
    from_cache = contribution_weights_from_cache(model, cache, tokens=tokens)
    col_ctx = ContributionCollector(model)
    with model.hooks(fwd_hooks=col_ctx.fwd_hooks, reset_hooks_end=True):
        model(tokens)
    col_rwc = ContributionCollector(model, intra=["contribution"], inter=["contribution"])
    with model.hooks(fwd_hooks=col_rwc.fwd_hooks, reset_hooks_end=True):
        _, cache2 = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
    assert not has_hooks(model)
    for other in (from_cache, col_ctx.result(tokens)):
        for name in INTRA_METRICS:
            torch.testing.assert_close(other.intra[name], res.intra[name], atol=1e-6, rtol=0)
        for name in INTER_METRICS:
            torch.testing.assert_close(other.inter[name], res.inter[name], atol=1e-6, rtol=0)
    rwc = col_rwc.result(tokens)
    assert set(rwc.intra) == {"contribution"} and set(rwc.inter) == {"contribution"}
    torch.testing.assert_close(rwc.intra["contribution"], res.intra["contribution"], atol=1e-6, rtol=0)
    assert set(cache2.keys()) == {f"blocks.{la}.attn.hook_z" for la in range(2)}


def test_raising_user_hook_leaves_no_hooks() -> None:
    model = make_tiny(seed=20)
    tokens = random_tokens(1, 6, seed=21)

    def boom(tensor, hook):
        raise RuntimeError("user hook failed")

    with pytest.raises(RuntimeError, match="user hook failed"):
        contribution_weights(model, tokens, extra_hooks=[("blocks.1.attn.hook_v", boom)])
    assert not has_hooks(model)
    col = ContributionCollector(model)
    with pytest.raises(RuntimeError, match="user hook failed"):
        run_hooks(model, tokens, [*col.fwd_hooks, ("blocks.0.attn.hook_pattern", boom)])
    assert not has_hooks(model)
    # has_hooks is not vacuous
    model.add_hook("blocks.0.attn.hook_z", lambda t, hook: None)
    assert has_hooks(model)
    model.reset_hooks()
    # and the model still works afterwards
    contribution_weights(model, tokens, layers=[0], intra=["contribution"], inter=[])


def test_layer_subset_metric_subset_and_streaming_callback() -> None:
    model = make_tiny(n_layers=3, seed=22)
    tokens = random_tokens(1, 7, seed=23)
    full = contribution_weights(model, tokens)
    sub = contribution_weights(
        model, tokens, layers=[2, 0], intra=["contribution", "factor_cos"], inter=["attention"]
    )
    assert (
        sub.layers == [2, 0]
        and set(sub.intra) == {"contribution", "factor_cos"}
        and set(sub.inter) == {"attention"}
    )
    torch.testing.assert_close(sub.intra["contribution"][:, 0], full.intra["contribution"][:, 2])
    torch.testing.assert_close(sub.intra["factor_cos"][:, 1], full.intra["factor_cos"][:, 0])
    seen: dict[int, dict] = {}
    col = ContributionCollector(
        model, [1], intra=["head_share"], inter=["contribution"], on_layer=seen.__setitem__
    )
    run_hooks(model, tokens, col.fwd_hooks)
    assert list(seen) == [1]
    torch.testing.assert_close(seen[1]["inter"]["contribution"], full.inter["contribution"][:, 1])
    torch.testing.assert_close(seen[1]["intra"]["head_share"], full.intra["head_share"][:, 1])
    with pytest.raises(IndexError, match="was not analysed"):
        sub.layer_index(1)


def test_to_frame_rows_and_values() -> None:
    model = make_tiny(seed=24)
    tokens = random_tokens(2, 6, seed=25)
    res = contribution_weights(model, tokens)
    df = res.to_frame(batch=1, layers=[1], heads=[2, 3])
    assert len(df) == 2 * 6 * 7 // 2
    assert (df["key"] <= df["query"]).all()
    row = df[(df["head"] == 3) & (df["query"] == 4) & (df["key"] == 2)].iloc[0]
    assert row["contribution"] == pytest.approx(float(res.intra["contribution"][1, 1, 3, 4, 2]))
    assert row["layer_contribution"] == pytest.approx(float(res.inter["contribution"][1, 1, 4, 2]))
    assert row["factor_attention"] == row["attention"]
    assert len(res.to_frame(batch=None, query=5)) == 2 * 2 * 4 * 6


# --------------------------------------------------------------------------- bad input


def test_bad_input_errors() -> None:
    model = make_tiny(seed=26)
    tokens = random_tokens(1, 5)
    with pytest.raises(ValueError, match="empty text"):
        contribution_weights(model, "")
    with pytest.raises(ValueError, match="empty text"):
        contribution_weights(model, ["  "])
    with pytest.raises(ValueError, match="empty"):
        contribution_weights(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="n_ctx"):
        contribution_weights(model, random_tokens(1, 33))
    with pytest.raises(IndexError, match="out of range"):
        contribution_weights(model, tokens, layers=[2])
    with pytest.raises(IndexError, match="out of range"):
        contribution_weights(model, tokens, layers=-1)
    with pytest.raises(ValueError, match="unknown intra-head metric"):
        contribution_weights(model, tokens, intra=["contributions"])
    with pytest.raises(ValueError, match="unknown inter-head metric"):
        contribution_weights(model, tokens, inter=["head_share"])
    with pytest.raises(RuntimeError, match="no activations"):
        ContributionCollector(model).result(tokens)
    with pytest.raises(KeyError, match="hook_z"):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: not n.endswith("hook_z"))
        contribution_weights_from_cache(model, cache)
    assert not has_hooks(model)


@needs_hooked
def test_encoder_models_are_refused_where_an_analysis_needs_a_decoder() -> None:
    """Contribution weights accept encoders (tests/unit/test_encoder_contribution_unit.py); the analyses
    built on a causal pattern still refuse both kinds of TransformerLens 3 encoder, by name."""
    from transformer_lens import HookedEncoder, HookedTransformer, HookedTransformerConfig

    from mechgeom import classify_heads, token_selection

    cfg = HookedTransformerConfig(
        n_layers=1,
        d_model=8,
        n_ctx=8,
        d_head=4,
        n_heads=2,
        d_mlp=16,
        act_fn="gelu",
        d_vocab=10,
        attention_dir="bidirectional",
        seed=0,
    )
    tokens = torch.tensor([[1, 2, 3]])
    for model in (HookedTransformer(cfg), HookedEncoder(cfg)):
        for fn in (token_selection, classify_heads):
            with pytest.raises(TypeError, match=r"not a causal decoder.*supports causal decoders only"):
                fn(model, tokens)
        assert not has_hooks(model)


def test_streaming_with_reused_buffers_and_result_written_in_place() -> None:
    model = make_tiny(n_layers=3, n_kv=2, seed=40)
    tokens = random_tokens(2, 9, seed=41)
    full = contribution_weights(model, tokens)
    # without on_layer the metrics land directly in the result tensors; a second pass leaves them alone
    col = ContributionCollector(model, [2, 0])
    run_hooks(model, tokens, col.fwd_hooks)
    first = col.result(tokens)
    run_hooks(model, random_tokens(2, 9, seed=42), col.fwd_hooks)
    second = col.result(tokens)
    for name in INTRA_METRICS:
        torch.testing.assert_close(first.intra[name], full.intra[name][:, [2, 0]])
        assert not torch.equal(second.intra[name], first.intra[name])
    for name in INTER_METRICS:
        torch.testing.assert_close(first.inter[name], full.inter[name][:, [2, 0]])
    # reuse_buffers: every layer arrives in the same tensors, with that layer's values
    seen: dict[int, dict[str, torch.Tensor]] = {}
    ptrs: set[int] = set()

    def keep(layer: int, metrics: dict) -> None:
        ptrs.add(metrics["intra"]["contribution"].data_ptr())
        seen[layer] = {f"intra_{k}": t.clone() for k, t in metrics["intra"].items()}
        seen[layer].update({f"inter_{k}": t.clone() for k, t in metrics["inter"].items()})

    col = ContributionCollector(model, on_layer=keep, reuse_buffers=True)
    run_hooks(model, tokens, col.fwd_hooks)
    assert len(ptrs) == 1 and sorted(seen) == [0, 1, 2]
    for layer in range(3):
        for name in INTRA_METRICS:
            torch.testing.assert_close(seen[layer][f"intra_{name}"], full.intra[name][:, layer])
        for name in INTER_METRICS:
            torch.testing.assert_close(seen[layer][f"inter_{name}"], full.inter[name][:, layer])
    with pytest.raises(ValueError, match="on_layer"):
        ContributionCollector(model, reuse_buffers=True)
    _, cache = model.run_with_cache(tokens)
    alpha, v, z = acts_of(cache, 0)
    geo = LayerGeometry(alpha, expand_kv(v, 4), z, model.W_O[0].detach())
    with pytest.raises(ValueError, match="buffer for 'contribution'"):
        geo.compute(["contribution"], [], out_intra={"contribution": torch.empty(2, 4, 9, 8)})


def test_streamed_buffers_are_recycled_only_when_the_callback_keeps_nothing() -> None:
    # more queries than one block (BLOCK_SIZE), so recycled buffers skip the zeros after each block
    model = make_tiny(n_layers=3, n_kv=2, n_ctx=300, seed=45)
    tokens = random_tokens(2, BLOCK_SIZE + 70, seed=46)
    full = contribution_weights(model, tokens)

    def check(layer: int, intra: dict, inter: dict) -> None:
        for name in INTRA_METRICS:
            assert torch.equal(intra[name].nan_to_num(7.0), full.intra[name][:, layer].nan_to_num(7.0)), name
        for name in INTER_METRICS:
            assert torch.equal(inter[name].nan_to_num(7.0), full.inter[name][:, layer].nan_to_num(7.0)), name

    # 1. a callback that reduces (keeps nothing): the same tensors come back every layer (a weak
    #    reference does not keep a tensor alive, so the first layer's tensor lives on only if recycled)
    refs: list[weakref.ref] = []

    def reduce(layer: int, m: dict) -> None:
        refs.append(weakref.ref(m["intra"]["contribution"]))
        check(layer, m["intra"], m["inter"])

    col = ContributionCollector(model, on_layer=reduce)
    run_hooks(model, tokens, col.fwd_hooks)
    assert len(refs) == 3 and refs[0]() is not None and all(r() is refs[0]() for r in refs)
    # 2. a callback that keeps a view of one metric: that metric gets fresh memory, the others do not,
    #    and what it kept still holds its own layer's values after the pass
    kept: list[torch.Tensor] = []
    seen: dict[str, list[int]] = {"contribution": [], "factor_cos": []}

    def keep_view(layer: int, m: dict) -> None:
        for k in seen:
            seen[k].append(m["intra"][k].data_ptr())
        kept.append(m["intra"]["contribution"][:, 1:])

    col = ContributionCollector(model, on_layer=keep_view)
    run_hooks(model, tokens, col.fwd_hooks)
    assert len(set(seen["contribution"])) == 3 and len(set(seen["factor_cos"])) == 1
    for layer, t in enumerate(kept):
        assert torch.equal(t.nan_to_num(7.0), full.intra["contribution"][:, layer, 1:].nan_to_num(7.0))

    # 3. a callback that writes into its tensors (here: everywhere, the zeros above the diagonal
    #    included): the next layer's values are still exact, zeros included
    def scribble(layer: int, m: dict) -> None:
        check(layer, m["intra"], m["inter"])
        for t in [*m["intra"].values(), *m["inter"].values()]:
            if t.data_ptr() != m["intra"]["attention"].data_ptr():
                t.fill_(5.0)

    col = ContributionCollector(model, on_layer=scribble)
    run_hooks(model, tokens, col.fwd_hooks)
    # 4. without the storage count (another PyTorch), nothing is recycled and the values stay exact
    refs.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.delattr(torch._C, "_storage_Use_Count")
        col = ContributionCollector(model, on_layer=reduce)
        run_hooks(model, tokens, col.fwd_hooks)
    assert len(refs) == 3 and refs[0]() is None and refs[1]() is None


# --------------------------------------------------------------------------- one collector signature, progress, layout


def test_result_derives_string_tokens_from_the_tokenizer() -> None:
    model = make_tiny(seed=43)
    tokens = random_tokens(2, 5, seed=44)
    col = ContributionCollector(model, [0], intra=["contribution"], inter=[])
    run_hooks(model, tokens, col.fwd_hooks)
    assert col.result().tokens is None and col.result().str_tokens is None
    assert col.result(tokens).str_tokens is None  # a tiny model has no tokenizer
    # a model with a tokenizer: its strings, one list per text, in the result and its table
    model.tokenizer = SimpleNamespace(padding_side="right")  # what a forward pass reads of it (a fresh model)
    model.to_str_tokens = lambda row: [f"<{int(t)}>" for t in row]
    res = col.result(tokens)
    assert res.str_tokens == [[f"<{int(t)}>" for t in row] for row in tokens]
    df = res.to_frame(batch=1, heads=[0])
    assert (df["key_token"] == [f"<{int(tokens[1, k])}>" for k in df["key"]]).all()
    assert contribution_weights(model, tokens, layers=[0]).str_tokens == res.str_tokens
    _, cache = model.run_with_cache(tokens)
    assert (
        contribution_weights_from_cache(model, cache, layers=[0], tokens=tokens).str_tokens == res.str_tokens
    )
    assert contribution_weights_from_cache(model, cache, layers=[0]).str_tokens is None


def test_verbose_shows_a_bar_over_layers_and_changes_nothing(capsys, monkeypatch) -> None:
    from mechgeom.analyses.contribution import weights as contribution

    model = make_tiny(n_layers=3, seed=45)
    tokens = random_tokens(1, 6, seed=46)
    quiet = contribution_weights(model, tokens, intra=["contribution"], inter=["contribution"])
    assert "contributions" not in capsys.readouterr().err
    loud = contribution_weights(model, tokens, intra=["contribution"], inter=["contribution"], verbose=True)
    assert "contributions" in capsys.readouterr().err
    assert torch.equal(quiet.intra["contribution"], loud.intra["contribution"])
    # the bar advances once per layer, as each layer is computed, and closes after the pass
    events: list[tuple[str, object]] = []
    real_on_layer = ContributionCollector.on_layer

    def on_layer(self, acts):
        events.append(("computed", acts.layer))
        real_on_layer(self, acts)

    def fake_progress(iterable, *, desc, enabled=True, total=None):
        events.append(("open", (desc, enabled, total)))
        try:
            for x in iterable:
                yield x
                events.append(("step", x))
        finally:
            events.append(("close", None))

    monkeypatch.setattr(contribution, "progress", fake_progress)
    monkeypatch.setattr(ContributionCollector, "on_layer", on_layer)
    contribution_weights(model, tokens, layers=[2, 0], intra=["contribution"], inter=[], verbose=True)
    assert events == [
        ("open", ("contributions", True, 2)),
        ("computed", 0),
        ("step", 2),
        ("computed", 2),
        ("step", 0),
        ("close", None),
    ]

    # a failing pass closes the bar and leaves no hooks
    def boom(tensor, hook):
        raise RuntimeError("user hook failed")

    events.clear()
    with pytest.raises(RuntimeError, match="user hook failed"):
        contribution_weights(model, tokens, extra_hooks=[("blocks.1.attn.hook_v", boom)], verbose=True)
    assert not has_hooks(model)
    assert events[0] == ("open", ("contributions", True, 3)) and ("computed", 0) in events
    assert events[-1] == ("close", None) and ("step", 1) not in events


def test_geometry_lives_in_its_module_and_uses_the_shared_gram() -> None:
    from mechgeom import maths
    from mechgeom.analyses import contribution
    from mechgeom.analyses.contribution import (
        geometry as contribution_geometry,
        overview as contribution_overview,
    )

    assert contribution.LayerGeometry is contribution_geometry.LayerGeometry
    assert contribution.INTRA_METRICS is contribution_geometry.INTRA_METRICS
    assert contribution.INTER_METRICS is contribution_geometry.INTER_METRICS
    assert "LayerGeometry" in contribution.__all__
    assert {"ContributionOverview", "contribution_overview"} <= set(contribution_overview.__all__)
    assert not hasattr(contribution, "_wo_gram_full") and not hasattr(contribution_geometry, "_WO_GRAMS")
    model = make_tiny(n_kv=2, seed=47)
    _, cache = model.run_with_cache(random_tokens(1, 5, seed=48))
    alpha, v, z = acts_of(cache, 1)
    W = model.W_O[1].detach()
    geo = LayerGeometry(alpha, expand_kv(v, 4), z, W)
    assert geo.wo_gram_full is maths.wo_gram_full(W)  # the one cache of mechgeom.maths
    assert torch.equal(geo.wo_gram, maths.wo_gram(W))
    torch.testing.assert_close(geo.wo_gram, torch.einsum("hdm,hem->hde", W, W))


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 9])
def test_gram_of_each_head_pair_once_matches_materialised_values(
    n_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``G_j[h,g] = <vt[j,h], vt[j,g]>`` from each unordered pair once (odd and even head counts), in chunks."""
    from mechgeom.analyses.contribution import geometry as contribution_geometry

    monkeypatch.setattr(contribution_geometry, "GRAM_CHUNK", 7)  # several chunks, the last one partial
    g = torch.Generator().manual_seed(n_heads)
    B, K, D, M = 2, 11, 3, 5
    W = torch.randn(n_heads, D, M, generator=g, dtype=torch.float64)
    v = expand_kv(torch.randn(B, K, 1, D, generator=g, dtype=torch.float64), n_heads)  # one KV head (MQA)
    v = v + torch.randn(B, K, n_heads, D, generator=g, dtype=torch.float64)  # and per-head values
    z = torch.randn(B, K, n_heads, D, generator=g, dtype=torch.float64)
    alpha = torch.softmax(torch.randn(B, n_heads, K, K, generator=g, dtype=torch.float64), -1)
    workspace: dict[str, torch.Tensor] = {}
    vt = torch.einsum("bkhd,hdm->bkhm", v, W)  # materialised [b k h d_model]
    ref = torch.einsum("bkhm,bkgm->bkhg", vt, vt)
    for _ in range(2):  # the second time on the workspace's recycled temporaries
        geo = LayerGeometry(alpha, v, z, W, workspace=workspace)
        torch.testing.assert_close(geo.gram, ref, atol=1e-12, rtol=0)
        assert torch.equal(geo.gram, geo.gram.transpose(-1, -2))
        torch.testing.assert_close(geo.vt_norm, vt.norm(dim=-1).transpose(1, 2), atol=1e-12, rtol=0)
    assert {"gram_y", "gram_v"} <= set(workspace)
