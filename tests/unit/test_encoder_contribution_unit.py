"""Contribution weights on a bidirectional model (an encoder), against the brute-force reference.

Tiny random encoders: ``make_tiny(attention_dir="bidirectional")`` works on both TransformerLens lines (a
``HookedTransformer`` on 3.x, ``TransformerBridge.boot_native`` on 4.x), and a ``HookedEncoder`` on 3.x.
Every key is a source of every query; padding (an attention mask) is neither a source nor a query.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hooked_encoder, make_tiny, needs_hooked, random_tokens
from reference_contribution import acts_of, assert_all_metrics_match, brute_force

from mechgeom.analyses.contribution.weights import (
    INTER_METRICS,
    INTRA_METRICS,
    ContributionCollector,
    LayerGeometry,
    contribution_weights,
)
from mechgeom.hooks import (
    LayerCollector,
    expand_kv,
    has_hooks,
    hook_name,
    is_bidirectional,
    padding_mask,
    run_hooks,
    to_tokens,
)

# every test runs on the fused and the plain-torch sweep (conftest.sweep_path)
pytestmark = pytest.mark.usefixtures("sweep_path")


def _encoder(seed: int, **kw) -> object:
    return make_tiny(attention_dir="bidirectional", seed=seed, **kw)


def _cache(model, tokens, mask=None):
    kwargs = {} if mask is None else {"attention_mask": mask}
    _, cache = model.run_with_cache(tokens, **kwargs)
    return cache


@pytest.mark.parametrize(
    "kw", [dict(), dict(n_kv=2), dict(attn_only=True, b_O=False)], ids=["mha", "gqa", "ao"]
)
def test_encoder_metrics_match_materialised_reference_with_every_key(kw) -> None:
    model = _encoder(60, **kw)
    assert is_bidirectional(model)
    tokens = random_tokens(batch=2, pos=9, seed=61)
    res = contribution_weights(model, tokens)
    assert not res.causal and res.key_mask is None
    cache = _cache(model, tokens)
    for li, layer in enumerate(res.layers):
        alpha, v, _ = acts_of(cache, layer)
        ref = brute_force(alpha, v, model.W_O[layer], causal=False)
        intra = {k: t[:, li] for k, t in res.intra.items()}
        inter = {k: t[:, li] for k, t in res.inter.items()}
        assert_all_metrics_match(intra, inter, ref)
        # not a decoder's layout: queries see later keys, with real weight there
        upper = torch.ones(9, 9, dtype=torch.bool).triu(1)
        assert (intra["contribution"][..., upper].abs() > 1e-3).any()
        assert (intra["factor_cos"][..., upper] != 0).all()
        # the identities over every key
        ones = torch.ones(2, model.cfg.n_heads, 9)
        torch.testing.assert_close(intra["contribution"].sum(-1), ones, atol=1e-4, rtol=0)
        torch.testing.assert_close(intra["head_share"].sum((1, 3)), ones[:, 0], atol=1e-4, rtol=0)
        torch.testing.assert_close(inter["contribution"].sum(-1), ones[:, 0], atol=1e-4, rtol=0)
        c = intra["attention"] * intra["factor_norm_ratio"] * intra["factor_cos"]
        torch.testing.assert_close(c, intra["contribution"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [1, 3, 128])
def test_encoder_blocked_sweep_matches_reference_for_any_block_size(block_size: int) -> None:
    model = _encoder(62, n_kv=2)
    tokens = random_tokens(batch=2, pos=10, seed=63)
    alpha, v, z = acts_of(_cache(model, tokens), 1)
    W = model.W_O[1].detach()
    ref = brute_force(alpha, v, W, causal=False)
    geo = LayerGeometry(alpha, expand_kv(v, model.cfg.n_heads), z, W, block_size=block_size, causal=False)
    intra, inter = geo.compute()
    assert_all_metrics_match(intra, inter, ref)
    # the causal kernel on the same activations would be wrong: the layouts differ
    causal = LayerGeometry(alpha, expand_kv(v, model.cfg.n_heads), z, W, block_size=block_size).compute()
    assert not torch.allclose(causal[0]["factor_cos"], intra["factor_cos"])


def _padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    lengths = [9, 6, 4]
    tokens = random_tokens(batch=3, pos=9, seed=seed)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        tokens[b, n:] = 0
    return tokens, mask, lengths


def test_padded_encoder_batch_excludes_padding_and_equals_each_text_alone() -> None:
    model = _encoder(64, n_kv=2)
    tokens, mask, lengths = _padded_batch(65)
    res = contribution_weights(model, tokens, attention_mask=mask)
    real = mask.bool()
    assert torch.equal(res.key_mask, real)
    cache = _cache(model, tokens, mask)
    pair = real[:, :, None] & real[:, None, :]  # [b q k]
    for li, layer in enumerate(res.layers):
        alpha, v, _ = acts_of(cache, layer)
        assert (alpha.transpose(1, 3)[~real] == 0).all()  # no query attends to a padded key
        ref = brute_force(alpha, v, model.W_O[layer], causal=False, real=real)
        intra = {k: t[:, li] for k, t in res.intra.items()}
        inter = {k: t[:, li] for k, t in res.inter.items()}
        assert_all_metrics_match(intra, inter, ref)
        for name, t in intra.items():  # padding: exactly 0, factors included
            assert (t.permute(0, 2, 3, 1)[~pair] == 0).all(), name
        for name, t in inter.items():
            assert (t[~pair] == 0).all(), name
        rows = res.intra["contribution"][:, li].sum(-1)  # [b h q]
        torch.testing.assert_close(
            rows.permute(0, 2, 1)[real], torch.ones(int(real.sum()), 4), atol=1e-4, rtol=0
        )
        assert (rows.permute(0, 2, 1)[~real] == 0).all()
    # each text alone (no padding) gives the same numbers on its real tokens
    for b, n in enumerate(lengths):
        alone = contribution_weights(model, tokens[b : b + 1, :n])
        for name in INTRA_METRICS:
            torch.testing.assert_close(
                res.intra[name][b : b + 1, ..., :n, :n], alone.intra[name], atol=2e-5, rtol=1e-4, msg=name
            )
        for name in INTER_METRICS:
            torch.testing.assert_close(
                res.inter[name][b : b + 1, ..., :n, :n], alone.inter[name], atol=2e-5, rtol=1e-4, msg=name
            )
    # the tidy table holds the real pairs only, every pair of them
    frame = res.to_frame(batch=1, layers=0, heads=0)
    assert len(frame) == lengths[1] ** 2
    assert frame["query"].max() == lengths[1] - 1 and frame["key"].max() == lengths[1] - 1


def test_padding_is_found_from_the_pattern_when_hooks_are_used_directly() -> None:
    model = _encoder(66)
    tokens, mask, _ = _padded_batch(67)
    col = ContributionCollector(model, intra=["contribution", "factor_cos"], inter=["contribution"])
    with torch.no_grad():
        model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=col.fwd_hooks)
    assert not has_hooks(model)
    res = col.result(tokens)
    assert torch.equal(res.key_mask, mask.bool())
    ref = contribution_weights(model, tokens, attention_mask=mask, intra=["contribution", "factor_cos"])
    torch.testing.assert_close(res.intra["factor_cos"], ref.intra["factor_cos"])
    with pytest.raises(ValueError, match="needs the intra-head metric"):
        res.summary()  # the encoder summary needs attention, value_weighted_normalized and contribution


def test_encoder_summary_reads_cls_and_sep_of_each_text() -> None:
    model = _encoder(78)
    tokens, mask, lengths = _padded_batch(79)
    res = contribution_weights(model, tokens, attention_mask=mask)
    frame = res.special_token_frame()
    assert len(frame) == model.cfg.n_layers * model.cfg.n_heads * 2
    for layer in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            for token in ("[CLS]", "[SEP]"):
                row = frame[
                    (frame["layer"] == layer) & (frame["head"] == h) & (frame["token"] == token)
                ].iloc[0]
                for m in ("attention", "value_weighted_normalized", "contribution"):
                    vals = [
                        float(res.intra[m][b, layer, h, i, 0 if token == "[CLS]" else n - 1])
                        for b, n in enumerate(lengths)
                        for i in range(n)
                    ]
                    assert row[m] == pytest.approx(sum(vals) / len(vals), rel=1e-5, abs=1e-7), (
                        layer,
                        h,
                        token,
                        m,
                    )
                c = res.intra["contribution"][:, layer, h]
                neg = [
                    float(c[b, i, j]) < 0 for b, n in enumerate(lengths) for i in range(n) for j in range(n)
                ]
                assert row["negative_share"] == pytest.approx(sum(neg) / len(neg))
    s = res.summary()
    assert s["n_heads"] == model.cfg.n_layers * model.cfg.n_heads and s["n_texts"] == 3
    cls = frame[frame.token == "[CLS]"]
    assert s["cls_contribution"] == pytest.approx(cls["contribution"].mean())
    assert s["sep_attention"] == pytest.approx(frame[frame.token == "[SEP]"]["attention"].mean())


def test_padding_mask_comes_from_the_tokenizer_pad_token() -> None:
    model = _encoder(68)
    tokens, mask, _ = _padded_batch(69)
    assert padding_mask(model, tokens) is None  # no tokenizer, no pad token: the caller gives the mask
    model.tokenizer = type("Tok", (), {"pad_token_id": 0})()
    try:
        torch.testing.assert_close(padding_mask(model, tokens), mask.bool())
        assert padding_mask(model, tokens[:1]) is None  # nothing padded
        assert padding_mask(make_tiny(seed=1), tokens) is None  # a decoder never gets one
        # run_hooks passes it to the model: the same pattern as an explicit mask
        seen = {}
        run_hooks(model, tokens, [(hook_name(0, "pattern"), lambda t, hook: seen.setdefault("p", t.clone()))])
        torch.testing.assert_close(seen["p"], _cache(model, tokens, mask)["blocks.0.attn.hook_pattern"])
    finally:
        model.tokenizer = None


def test_intervention_on_an_encoder_is_marked_and_the_identities_hold() -> None:
    model = _encoder(70, n_kv=2)
    tokens = random_tokens(batch=2, pos=8, seed=71)

    def zero_head(z, hook):  # z: [batch pos head d_head]
        z = z.clone()
        z[:, :, 1] = 0.0
        return z

    res = contribution_weights(model, tokens, extra_hooks=[(hook_name(1, "z"), zero_head)])
    assert res.modified_heads == [(1, 1)]
    li = res.layers.index(1)
    share = res.modified_share[:, li].sum(1)  # [b q]
    torch.testing.assert_close(
        res.inter["contribution"][:, li].sum(-1) + share, torch.ones(2, 8), atol=1e-4, rtol=0
    )
    assert res.intra["contribution"][:, li, 1].isnan().all()


def test_encoder_reader_captures_every_key_for_modified_mask() -> None:
    model = _encoder(72)
    tokens = random_tokens(batch=1, pos=7, seed=73)
    col = LayerCollector(model, [0])
    run_hooks(model, tokens, col.fwd_hooks)
    acts = col.captured[0]
    assert not acts.causal and acts.key_mask is None
    assert not acts.any_modified  # a causal (blocked) check would mark every query here


@needs_hooked
def test_hooked_encoder_matches_reference_with_a_padding_mask() -> None:
    model = make_hooked_encoder(74)
    tokens, mask, lengths = _padded_batch(75)
    res = contribution_weights(model, tokens, attention_mask=mask)
    _, cache = model.run_with_cache(tokens, one_zero_attention_mask=mask)
    real = mask.bool()
    for li, layer in enumerate(res.layers):
        alpha, v, _ = acts_of(cache, layer)
        v = v - model.blocks[layer].attn.b_V  # vt = x W_V W_O, without the value bias (definitions §1.3)
        ref = brute_force(alpha, v, model.W_O[layer], causal=False, real=real)
        assert_all_metrics_match(
            {k: t[:, li] for k, t in res.intra.items()}, {k: t[:, li] for k, t in res.inter.items()}, ref
        )
    alone = contribution_weights(model, tokens[1:2, : lengths[1]])
    n = lengths[1]
    torch.testing.assert_close(
        res.intra["contribution"][1:2, ..., :n, :n], alone.intra["contribution"], atol=2e-5, rtol=1e-4
    )


def test_decoder_only_analyses_refuse_an_encoder_clearly() -> None:
    from mechgeom import classify_heads, contribution_overview, head_stats, perplexity_curves, token_selection

    model = _encoder(76)
    tokens = random_tokens(batch=2, pos=6, seed=77)
    for fn in (contribution_overview, token_selection, classify_heads, head_stats):
        with pytest.raises(TypeError, match="supports causal decoders only"):
            fn(model, tokens)
    with pytest.raises(TypeError, match="supports causal decoders only"):
        perplexity_curves(model, tokens, rates=[0.5])
    with pytest.raises(TypeError, match="not a causal decoder"):
        to_tokens(model, tokens)
    assert to_tokens(model, tokens, encoders=True).shape == (2, 6)


@needs_hooked
def test_a_padding_mask_on_a_bidirectional_hooked_transformer_is_refused() -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=1, d_model=8, n_ctx=8, d_head=4, n_heads=2, d_mlp=16, act_fn="gelu", d_vocab=10,
        attention_dir="bidirectional", seed=0,
    )  # fmt: skip
    model = HookedTransformer(cfg)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 0]])
    with pytest.raises(ValueError, match="ignores attention masks"):
        contribution_weights(model, tokens, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert not has_hooks(model)
    # without padding it is an encoder like any other: every key of every query
    res = contribution_weights(model, tokens[:1])
    _, cache = model.run_with_cache(tokens[:1])
    alpha, v, _ = acts_of(cache, 0)
    ref = brute_force(alpha, v, model.W_O[0], causal=False)
    assert_all_metrics_match(
        {k: t[:, 0] for k, t in res.intra.items()}, {k: t[:, 0] for k, t in res.inter.items()}, ref
    )
