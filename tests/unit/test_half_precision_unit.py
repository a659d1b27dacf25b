"""Half precision (issue 35, point 4): a bfloat16 or float16 model's activations are read as they are, every
contribution metric is computed in float32 (``docs/definitions.md``, "Half precision"), the results are float32
unless ``out_dtype=`` says otherwise, both sweeps give the same numbers, and the check of modified heads
(:func:`~mechgeom.hooks.modified_mask`) tells the model's own rounding from an intervention."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny, random_tokens
from reference_contribution import acts_of, assert_all_metrics_match, brute_force

from mechgeom._kernels import fused
from mechgeom.analyses.contribution.geometry import INTER_METRICS, INTRA_METRICS, LayerGeometry
from mechgeom.analyses.contribution.weights import (
    ContributionCollector,
    contribution_weights,
    reconstruct_attn_out,
)
from mechgeom.hooks import LayerCollector, modified_mask
from mechgeom.hooks.readers import MODIFIED_RTOL

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", params=HALF, ids=["bf16", "fp16"])
def half(request: pytest.FixtureRequest):
    """``(model, tokens, cache)``: a tiny random GQA decoder cast to half precision, and its activations."""
    model = make_tiny(n_kv=2, seed=3).to(request.param)
    tokens = random_tokens(batch=2, pos=14, seed=4)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "attn.hook_" in n)
    return model, tokens, cache


def _layer_of(result, li: int) -> tuple[dict, dict]:
    return {k: t[:, li] for k, t in result.intra.items()}, {k: t[:, li] for k, t in result.inter.items()}


def test_half_precision_metrics_are_float32_sum_to_one_and_equal_the_brute_force(half, sweep_path) -> None:
    """Every metric equals the float64 brute force on the same (upcast) activations to 1e-5, in float32: not
    ±0.016 (bfloat16) or ±0.002 (float16) as when the metrics were computed in the model's dtype."""
    model, tokens, cache = half
    res = contribution_weights(model, tokens)
    assert {t.dtype for t in (*res.intra.values(), *res.inter.values(), res.modified_share)} == {
        torch.float32
    }
    ones = torch.ones(2, 2, 4, 14)
    torch.testing.assert_close(res.intra["contribution"].sum(-1), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.inter["contribution"].sum(-1), ones[:, :, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(res.intra["head_share"].sum((2, 4)), ones[:, :, 0], atol=1e-5, rtol=0)
    assert not res.modified.any()
    for li, layer in enumerate(res.layers):
        alpha, v, _ = acts_of(cache, layer)
        assert alpha.dtype == model.cfg.dtype
        ref = brute_force(alpha, v, model.blocks[layer].attn.W_O)
        assert_all_metrics_match(*_layer_of(res, li), ref, atol=1e-5)
        assert torch.equal(res.intra["attention"][:, li], alpha.float())  # the pattern, upcast exactly


def test_out_dtype_gives_the_float32_numbers_rounded_once(half) -> None:
    model, tokens, _ = half
    ref = contribution_weights(model, tokens, intra=["contribution", "attention"], inter=["contribution"])
    got = contribution_weights(
        model, tokens, intra=["contribution", "attention"], inter=["contribution"], out_dtype=torch.bfloat16
    )
    for a, b in ((got.intra, ref.intra), (got.inter, ref.inter)):
        for k in a:
            assert a[k].dtype == torch.bfloat16
            assert torch.equal(a[k], b[k].to(torch.bfloat16)), k
    assert got.modified_share is not None and got.modified_share.dtype == torch.bfloat16

    seen: dict[int, dict] = {}
    col = ContributionCollector(
        model, intra=["contribution"], inter=["contribution"], out_dtype=torch.float64,
        on_layer=lambda layer, p: seen.__setitem__(layer, {k: t.clone() for k, t in p["intra"].items()}),
    )  # fmt: skip
    model.run_with_hooks(tokens, fwd_hooks=col.fwd_hooks)
    for li, layer in enumerate(ref.layers):
        assert seen[layer]["contribution"].dtype == torch.float64
        assert torch.equal(seen[layer]["contribution"], ref.intra["contribution"][:, li].double())


def test_a_clean_half_precision_pass_with_another_hook_marks_no_head_and_an_ablation_is_found(half) -> None:
    """With another hook on the layer the reader checks ``z`` against ``alpha @ v``: the model's rounding of
    ``z`` to its dtype is not an intervention, a removed head is."""
    model, tokens, _ = half

    def look(z, hook):  # reads, changes nothing
        return z

    def remove_head_1(z, hook):  # [batch pos head d_head]
        z = z.clone()
        z[:, :, 1] = 0
        return z

    clean = contribution_weights(model, tokens, extra_hooks=[("blocks.1.attn.hook_z", look)])
    assert not clean.modified.any()
    torch.testing.assert_close(
        clean.intra["contribution"].sum(-1), torch.ones(2, 2, 4, 14), atol=1e-5, rtol=0
    )
    ablated = contribution_weights(model, tokens, extra_hooks=[("blocks.1.attn.hook_z", remove_head_1)])
    assert ablated.modified_heads == [(1, 1)]
    assert not ablated.modified[:, 0].any() and ablated.modified[:, 1, 1].all()
    # the removed head has no per-source terms, the others and the layer still sum to 1 with its share
    c_inter = ablated.inter["contribution"][:, 1].sum(-1) + ablated.modified_share[:, 1].sum(1)
    torch.testing.assert_close(c_inter, torch.ones(2, 14), atol=1e-5, rtol=0)
    qq, kk = torch.tril_indices(14, 14)  # its sources: NaN (no per-source terms); keys after a query: 0
    assert ablated.intra["contribution"][:, 1, 1, qq, kk].isnan().all()
    assert ablated.modified_share[:, 1, 1].abs().max() == 0  # a zeroed head's share is 0


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_modified_mask_in_half_precision_is_the_models_rounding_bound(dtype) -> None:
    """``z`` as a half-precision model computes it (the float32 sum rounded, or a product in its dtype) is
    never marked at any length; a change of 4 units of roundoff of the scale is."""
    g = torch.Generator().manual_seed(0)
    B, H, Q, D = 2, 3, 300, 16
    scores = torch.randn(B, H, Q, Q, generator=g).masked_fill(
        torch.ones(Q, Q, dtype=torch.bool).triu(1), -1e9
    )
    alpha = scores.softmax(-1).to(dtype)
    v = (torch.randn(B, Q, H, D, generator=g) * 3).to(dtype)
    exact = torch.einsum("bhqk,bkhd->bqhd", alpha.float(), v.float())
    for z in (exact.to(dtype), torch.einsum("bhqk,bkhd->bqhd", alpha, v)):
        assert not modified_mask(alpha, v, z, causal=True).any()
        assert not modified_mask(alpha, v, z, causal=False).any()
    u = torch.finfo(dtype).eps / 2  # unit roundoff: 2**-8 (bfloat16), 2**-11 (float16)
    assert MODIFIED_RTOL[dtype] == 2 * u
    scale = torch.einsum("bhqk,bkh->bqh", alpha.float(), v.float().norm(dim=-1)) + exact.norm(dim=-1)
    nudged = exact.clone()
    nudged[:, :, 2, 0] += 4 * u * scale[:, :, 2]  # head 2 moved by twice the tolerance
    marked = modified_mask(alpha, v, nudged.to(dtype), causal=True)
    assert marked[:, 2].all() and not marked[:, :2].any()


def test_the_fused_sweep_reads_half_precision_like_the_plain_one(monkeypatch) -> None:
    """The C kernel is float32/float64: the fused sweep upcasts each block of a half-precision pattern and
    gives the plain sweep's numbers, which are those of float32 inputs, in every layout."""
    if not fused.available(torch.zeros(1)):
        pytest.skip("no C compiler: the fused kernel is not built")
    for dtype, causal, mod, bs in itertools.product(HALF, [True, False], [False, True], [4, None]):
        g = torch.Generator().manual_seed(7)
        B, H, Q, D, M = 2, 3, 37, 5, 7
        scores = torch.randn(B, H, Q, Q, generator=g)
        if causal:
            scores = scores.masked_fill(torch.ones(Q, Q, dtype=torch.bool).triu(1), float("-inf"))
        alpha = scores.softmax(-1).to(dtype)
        v = torch.randn(B, Q, H, D, generator=g).to(dtype)
        z = torch.einsum("bhqk,bkhd->bqhd", alpha, v)
        W = (torch.randn(H, D, M, generator=g) / M**0.5).to(dtype)
        modified = torch.rand(B, H, Q, generator=g) < 0.2 if mod else None
        key_mask = None if causal else torch.arange(Q)[None, :] < torch.tensor([[Q], [20]])

        def make(alpha=alpha, v=v, z=z, W=W, modified=modified, causal=causal, key_mask=key_mask, bs=bs):
            return LayerGeometry(
                alpha, v, z, W, block_size=bs, modified=modified, causal=causal, key_mask=key_mask
            )

        geo = make()
        assert (
            geo.dtype == torch.float32 and geo.pattern is alpha
        )  # never a whole float32 copy of the pattern
        got = geo.compute()
        with monkeypatch.context() as m:
            m.setattr(fused, "available", lambda pattern: False)
            plain = make().compute()
            # float32 inputs: the half-precision values upcast, z the float32 sum (the model's z where modified)
            z32 = torch.einsum("bhqk,bkhd->bqhd", alpha.float(), v.float())
            if modified is not None:
                z32 = torch.where(modified.transpose(1, 2)[..., None], z.float(), z32)
            f32 = LayerGeometry(
                alpha.float(), v.float(), z32, W.float(), block_size=bs, modified=modified, causal=causal,
                key_mask=key_mask,
            ).compute()  # fmt: skip
        for a, b, c in zip(got, plain, f32, strict=True):
            for k in a:
                assert a[k].dtype == torch.float32, k
                for other in (b, c):
                    assert torch.equal(a[k].isnan(), other[k].isnan()), k
                    torch.testing.assert_close(a[k].nan_to_num(), other[k].nan_to_num(), atol=1e-6, rtol=1e-5)
        if causal and not mod:
            assert_all_metrics_match(*got, brute_force(alpha, v, W), atol=1e-5)
    assert set(INTRA_METRICS) and set(INTER_METRICS)


def test_reconstruct_attn_out_in_half_precision_is_float32_and_the_models_output_to_its_rounding(
    half,
) -> None:
    model, tokens, _ = half
    col = LayerCollector(model)
    with model.hooks(fwd_hooks=col.fwd_hooks, reset_hooks_end=True):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_attn_out"))
    for layer in range(model.cfg.n_layers):
        got = reconstruct_attn_out(model, col.captured[layer])
        want = cache[f"blocks.{layer}.hook_attn_out"]
        assert got.dtype == torch.float32 and want.dtype == model.cfg.dtype
        eps = torch.finfo(model.cfg.dtype).eps
        torch.testing.assert_close(got, want.float(), atol=8 * eps * float(want.float().abs().max()), rtol=0)


def test_kept_queries_of_a_half_precision_model_are_the_rows_of_the_whole_result(half) -> None:
    """``queries=`` computes its rows in float32 as the whole layer does (``o`` remixed from ``alpha v`` in
    float32): the kept rows equal the same rows of the full result, and still sum to 1."""
    model, tokens, _ = half
    full = contribution_weights(model, tokens)
    kept = contribution_weights(model, tokens, queries=[0, 5, -1])
    assert {t.dtype for t in (*kept.intra.values(), *kept.inter.values())} == {torch.float32}
    rows = torch.tensor([0, 5, 13])
    for name, t in kept.intra.items():
        torch.testing.assert_close(t, full.intra[name][..., rows, :], atol=1e-6, rtol=1e-5, equal_nan=True)
    for name, t in kept.inter.items():
        torch.testing.assert_close(t, full.inter[name][..., rows, :], atol=1e-6, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(kept.intra["contribution"].sum(-1), torch.ones(2, 2, 4, 3), atol=1e-5, rtol=0)


def test_the_sink_analyses_read_a_half_precision_model() -> None:
    """The sink terms mix the pattern with the values, which a half-precision layer hands over upcast to
    float32 (the pattern stays as the model gave it): the sinks analysis upcasts the pattern too. It raised
    ("expected scalar type Float but found BFloat16") when the values were upcast alone. Its per-query sink
    mass and norm ratios equal the float32 model's to bfloat16 rounding (of the model: its attention moves
    by up to 0.03 on this tiny model with sharpened queries)."""
    from mechgeom import sink_statistics

    tokens = random_tokens(batch=2, pos=12, seed=6)
    ref = sink_statistics(make_tiny(seed=5), tokens)
    got = sink_statistics(make_tiny(seed=5).to(torch.bfloat16), tokens)
    finite = ref.sink_mass.isfinite()
    assert bool(finite.any()) and torch.equal(got.sink_mass.isfinite(), finite)
    torch.testing.assert_close(
        got.sink_mass[finite].double(), ref.sink_mass[finite].double(), atol=5e-2, rtol=0
    )
    torch.testing.assert_close(got.norm_ratio_vt.double(), ref.norm_ratio_vt.double(), atol=0, rtol=3e-2)
