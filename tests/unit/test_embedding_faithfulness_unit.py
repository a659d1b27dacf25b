"""Embedding faithfulness (paper A's masking on an encoder) against a brute-force reference, on tiny encoders.

Tiny random encoders: a ``HookedEncoder`` on TransformerLens 3.x (its ``TransformerBridge`` discards edits to
``hook_pattern``, so :func:`embedding_curves` masks it at ``hook_z``, tested on its own),
``make_tiny(attention_dir="bidirectional")`` (a ``TransformerBridge.boot_native`` model) on 4.x. The reference is built with explicit loops: per text, layer,
head and query, the real keys sorted by hand, the removal mask set entry by entry, one plain masked forward.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import HAS_HOOKED, fold_value_biases, make_hooked_encoder, make_tiny, pooled, random_tokens

from mechgeom.analyses.contribution.weights import contribution_weights
from mechgeom.analyses.faithfulness import embedding as ef
from mechgeom.analyses.faithfulness.embedding import (
    EMBEDDING_RATES,
    embedding_curves,
    embedding_effect,
    embedding_summary,
)
from mechgeom.analyses.faithfulness.rankings import random_scores, unit_hash
from mechgeom.hooks import (
    has_hooks,
    hook_name,
    masking_hooks,
    n_removed,
    rank_sources,
    removal_interval,
    removal_mask,
)

METRICS = ("attention", "value_weighted", "value_weighted_normalized", "contribution", "random")
MODES = ("comprehensiveness", "sufficiency")


def _encoder(seed: int) -> object:
    """A tiny random encoder whose forward follows ``hook_pattern`` edits, on either TransformerLens line."""
    if not HAS_HOOKED:
        return make_tiny(attention_dir="bidirectional", seed=seed)
    return make_hooked_encoder(seed)


def _padded(seed: int, lengths=(9, 6, 4), pos: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = random_tokens(batch=len(lengths), pos=pos, seed=seed)
    mask = torch.zeros(len(lengths), pos, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        tokens[b, n:] = 0
    return tokens, mask


# --------------------------------------------------------------------------- brute-force reference


def brute_order(scores: list[float]) -> list[int]:
    """Best first: larger score first, NaN last, ties by lower position."""
    return sorted(
        range(len(scores)),
        key=lambda j: (math.isnan(scores[j]), 0.0 if math.isnan(scores[j]) else -scores[j], j),
    )


def _zero_where(pattern, hook, m):
    return pattern.masked_fill(m, 0.0)


def brute_effects(model, tokens, mask, metric, scope, rate, mode, layers, seed=0) -> np.ndarray:
    n_texts, pos = tokens.shape
    n_heads = int(model.cfg.n_heads)
    if metric != "random":
        res = contribution_weights(
            model,
            tokens,
            attention_mask=mask,
            layers=layers,
            intra=[metric] if scope == "intra" else [],
            inter=[metric] if scope == "inter" else [],
        )
    masks = {la: torch.zeros(n_texts, n_heads, pos, pos, dtype=torch.bool) for la in layers}
    for t in range(n_texts):
        real = [j for j in range(pos) if mask[t, j]]
        n = len(real)
        k = math.ceil(Fraction(str(rate)) * n)
        for li, layer in enumerate(layers):
            if metric == "random":
                noise = random_scores(
                    n_heads if scope == "intra" else 1, n, n, seed=seed,
                    unit_hash=unit_hash(tokens[t, real]), layer=layer,
                )  # fmt: skip
            for h in range(n_heads):
                for qi, i in enumerate(real):
                    if metric == "random":
                        vals = [float(noise[h if scope == "intra" else 0, qi, kj]) for kj in range(n)]
                    elif scope == "intra":
                        vals = [float(res.intra[metric][t, li, h, i, j]) for j in real]
                    else:
                        vals = [float(res.inter[metric][t, li, i, j]) for j in real]
                    order = brute_order(vals)
                    removed = order[:k] if mode == "comprehensiveness" else order[n - k :]
                    for r in removed:
                        masks[layer][t, h, i, real[r]] = True

    hooks = [(hook_name(la, "pattern"), partial(_zero_where, m=masks[la])) for la in layers]
    clean = pooled(model, tokens, mask)
    # masking keeps the value bias whole (docs/definitions.md §1.3): the bare edit on the folded model
    masked = pooled(fold_value_biases(model), tokens, mask, fwd_hooks=hooks)
    cos = torch.nn.functional.cosine_similarity(masked.double(), clean.double(), dim=-1)
    return (1 - cos).numpy()


@pytest.mark.parametrize("scope,layers", [("intra", None), ("inter", [1])])
def test_curves_match_the_brute_force_reference(scope: str, layers) -> None:
    model = _encoder(80)
    tokens, mask = _padded(81)
    rates = (0.0, 0.25, 0.5, 1.0)
    res = embedding_curves(
        model, tokens, attention_mask=mask, metrics=METRICS, rates=rates, layers=layers, scope=scope,
        batch_size=2, embedding_fn=pooled,
    )  # fmt: skip
    assert res.effects.shape == (len(METRICS), 2, len(rates), 3)
    chosen = [0, 1] if layers is None else layers
    for i, metric in enumerate(METRICS):
        for j, mode in enumerate(MODES):
            for k, rate in enumerate(rates):
                ref = brute_effects(model, tokens, mask, metric, scope, rate, mode, chosen)
                np.testing.assert_allclose(res.effects[i, j, k], ref, atol=1e-6, rtol=0)
    assert (res.effects[:, :, 0] == 0).all()  # rate 0: exactly 0
    assert (res.effects[:, :, 1:] > 0).any()
    assert not has_hooks(model)


def test_rate_zero_is_exactly_zero_and_the_rate_zero_hook_is_the_identity() -> None:
    model = _encoder(82)
    tokens, mask = _padded(83)
    res = embedding_curves(
        model, tokens, attention_mask=mask, rates=(0.0, 0.5), embedding_fn=pooled, metrics=["contribution"]
    )
    assert (res.effects[:, :, 0] == 0).all()
    frame = res.to_frame()
    zero = frame[frame["rate"] == 0]
    assert (zero["effect"] == 0).all() and (zero["ci_low"] == 0).all() and (zero["ci_high"] == 0).all()
    # the masking hooks at rate 0 change nothing, bit for bit
    scores = contribution_weights(model, tokens, attention_mask=mask, intra=["contribution"])
    ranks = {
        la: rank_sources(scores.intra["contribution"][:, li], causal=False, key_mask=mask.bool())
        for li, la in enumerate(scores.layers)
    }
    n_src = mask.sum(-1, keepdim=True) * mask

    class R:
        pass

    ranking = R()
    ranking.ranks, ranking.layers = ranks, list(ranks)
    for mode in MODES:
        hooks = masking_hooks(model, ranking=ranking, rate=0.0, mode=mode, n_sources=n_src)
        assert torch.equal(pooled(model, tokens, mask, fwd_hooks=hooks), pooled(model, tokens, mask))


class _Recorder:
    """An embedding function that also records the pattern each pass used (a reader after the masking)."""

    def __init__(self, layers) -> None:
        self.layers = layers
        self.passes: list[dict[int, torch.Tensor]] = []

    def __call__(self, model, tokens, attention_mask, *, fwd_hooks=()):
        seen: dict[int, torch.Tensor] = {}
        readers = [
            (hook_name(la, "pattern"), lambda p, hook, la=la: seen.__setitem__(la, p.detach().clone()))
            for la in self.layers
        ]
        out = pooled(model, tokens, attention_mask, fwd_hooks=[*fwd_hooks, *readers])
        self.passes.append(seen)
        return out


@pytest.mark.parametrize("mode", MODES)
def test_rate_one_removes_every_real_source_and_leaves_padding(mode: str) -> None:
    model = _encoder(84)
    tokens, mask = _padded(85)
    rec = _Recorder([0, 1])
    res = embedding_curves(
        model, tokens, attention_mask=mask, metrics=["contribution"], rates=[1.0], modes=[mode],
        embedding_fn=rec, batch_size=8,
    )  # fmt: skip
    assert len(rec.passes) == 2  # one clean pass, one masked pass
    clean, masked = rec.passes
    real = mask.bool()
    for la in (0, 1):
        p = masked[la].permute(0, 2, 1, 3)  # [b q h k]
        assert (p[real] == 0).all()  # every real query: nothing left
        assert (clean[la].permute(0, 2, 1, 3)[real].sum(-1) > 0.99).all()
        # padded queries keep their whole row (layer 0: as clean; later layers see the changed real keys)
        torch.testing.assert_close(p[~real].sum(-1), torch.ones(int((~real).sum()), 4), atol=1e-5, rtol=0)
        if la == 0:
            assert torch.equal(p[~real], clean[la].permute(0, 2, 1, 3)[~real])
    assert (res.effects > 0).all()


def test_a_padded_batch_gives_each_text_its_effect_alone() -> None:
    model = _encoder(86)
    tokens, mask = _padded(87)
    rates = (0.0, 0.1, 0.5, 0.9)
    batched = embedding_curves(model, tokens, attention_mask=mask, rates=rates, embedding_fn=pooled)
    for t, n in enumerate(mask.sum(-1).tolist()):
        alone = embedding_curves(model, tokens[t : t + 1, :n], rates=rates, embedding_fn=pooled)
        assert alone.unit_hashes == [batched.unit_hashes[t]]
        np.testing.assert_allclose(batched.effects[..., t], alone.effects[..., 0], atol=1e-6, rtol=0)
    assert batched.n_tokens == [9, 6, 4]


def test_padded_keys_rank_last_and_are_never_removed() -> None:
    g = torch.Generator().manual_seed(88)
    scores = torch.randn(3, 4, 7, 7, generator=g)
    scores[0, 1, 2, 3] = float("nan")
    scores[:, :, :, 5:] = 9.0  # large scores at the padding must not matter
    key_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]]).bool()
    ranks = rank_sources(scores, causal=False, key_mask=key_mask)
    n_real = key_mask.sum(-1)
    for b in range(3):
        real = key_mask[b].nonzero().flatten().tolist()
        for h in range(4):
            for i in range(7):
                order = brute_order([float(scores[b, h, i, j]) for j in real])
                assert [ranks[b, h, i, real[r]].item() for r in order] == list(range(len(real)))
                assert sorted(ranks[b, h, i, ~key_mask[b]].tolist()) == list(range(len(real), 7))
    n_src = n_real[:, None] * key_mask.long()
    for rate in (0.1, 0.5, 0.9, 1.0):
        for mode in MODES:
            rm = removal_mask(ranks, rate, mode, n_src)
            assert not rm.permute(0, 3, 1, 2)[~key_mask].any()  # never a padded key
            assert not rm.permute(0, 2, 1, 3)[~key_mask].any()  # never at a padded query
            counts = rm.sum(-1).permute(0, 2, 1)[key_mask]  # [real queries, head]
            expect = [math.ceil(Fraction(str(rate)) * int(n)) for n in n_real for _ in range(int(n))]
            assert counts.tolist() == [[c] * 4 for c in expect]
    full = removal_mask(ranks, 1.0, "comprehensiveness", n_src)
    assert torch.equal(full, (key_mask[:, None, :, None] & key_mask[:, None, None, :]).expand_as(full))
    # a decoder's key_mask (issue 35: padded decoder batches) keeps the causal ranking where nothing is
    # padding, and is checked like an encoder's
    everything = torch.ones_like(key_mask)
    assert torch.equal(rank_sources(scores, key_mask=everything), rank_sources(scores))
    with pytest.raises(ValueError, match="key_mask"):
        rank_sources(scores, key_mask=key_mask[:, :5])


def test_counting_with_source_counts_and_the_decoder_default_unchanged() -> None:
    for q in range(1, 12):
        for rate in (0.0, 0.1, 0.3, 0.5, 0.7, 1.0):
            expect = [math.ceil(Fraction(str(rate)) * (i + 1)) for i in range(q)]
            assert n_removed(rate, q).tolist() == expect
            assert n_removed(rate, q, torch.arange(1, q + 1)).tolist() == expect
            for mode in MODES:
                lo, hi = removal_interval(rate, mode, q)
                lo2, hi2 = removal_interval(rate, mode, q, torch.arange(1, q + 1)[None])
                assert torch.equal(lo2[0], lo) and torch.equal(hi2[0], hi)
    assert n_removed(0.3, 2, torch.tensor([[10, 0]])).tolist() == [[3, 0]]
    with pytest.raises(ValueError, match="query_pos"):
        n_removed(0.5, 3, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="integer"):
        n_removed(0.5, 2, torch.tensor([1.0, 2.0]))


def test_random_control_is_reproducible_and_independent_of_batch_position() -> None:
    model = _encoder(89)
    tokens, mask = _padded(90)
    kw = dict(metrics=["random"], rates=(0.25, 0.5), embedding_fn=pooled)
    a = embedding_curves(model, tokens, attention_mask=mask, seed=3, batch_size=2, **kw)
    b = embedding_curves(model, tokens, attention_mask=mask, seed=3, batch_size=2, **kw)
    assert np.array_equal(a.effects, b.effects)
    c = embedding_curves(model, tokens, attention_mask=mask, seed=4, batch_size=2, **kw)
    assert not np.allclose(a.effects, c.effects)
    perm = [2, 0, 1]
    d = embedding_curves(model, tokens[perm], attention_mask=mask[perm], seed=3, batch_size=3, **kw)
    assert d.unit_hashes == [a.unit_hashes[p] for p in perm]
    np.testing.assert_allclose(d.effects, a.effects[..., perm], atol=1e-6, rtol=0)


def test_frames_summary_and_effect() -> None:
    model = _encoder(91)
    tokens, mask = _padded(92)
    res = embedding_curves(model, tokens, attention_mask=mask, embedding_fn=pooled, scope="inter")
    assert res.rates == EMBEDDING_RATES and res.metrics == METRICS
    frame = res.to_frame(n_boot=200)
    assert len(frame) == len(METRICS) * 2 * len(EMBEDDING_RATES)
    assert {"metric", "mode", "rate", "effect", "ci_low", "ci_high", "n_texts"} <= set(frame.columns)
    assert (frame["n_texts"] == 3).all() and (frame["scope"] == "inter").all()
    assert (
        (frame["ci_low"] <= frame["effect"] + 1e-12) & (frame["effect"] <= frame["ci_high"] + 1e-12)
    ).all()
    per_text = res.to_frame(per_text=True)
    assert len(per_text) == len(frame) * 3 and per_text["effect"].between(0, 2).all()
    means = per_text.groupby(["metric", "mode", "rate"], sort=False)["effect"].mean().to_numpy()
    np.testing.assert_allclose(means, frame["effect"].to_numpy())
    summary = res.summary()
    for mode in MODES:
        out = summary["modes"][mode]
        area = out["area"]
        x = np.array(EMBEDDING_RATES)
        for i, m in enumerate(METRICS):
            y = res.effects[i, MODES.index(mode)].mean(-1)
            assert area[m] == pytest.approx(float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2)))
        sign = 1 if mode == "comprehensiveness" else -1
        assert [v for _, v in out["ranking"]] == sorted(area.values(), key=lambda v: -sign * v)
        claimed = [area[m] for m in METRICS[:4]]
        ok = all(sign * (b - a) > 0 for a, b in itertools.pairwise(claimed))
        assert (out["verdict"] == "holds") == ok
    rows = [
        {"metric": m, "mode": mo, "rate": 0.5, "effect": v}
        for mo, vals in (("comprehensiveness", (1, 2, 3, 4)), ("sufficiency", (1, 2, 3, 4)))
        for m, v in zip(METRICS[:4], vals, strict=True)
    ]
    out = embedding_summary(pd.DataFrame(rows))
    assert out["modes"]["comprehensiveness"]["verdict"] == "holds"
    assert out["modes"]["sufficiency"]["verdict"] == "does not hold"
    assert out["modes"]["comprehensiveness"]["area"]["contribution"] == pytest.approx(1.0)  # (0,0) added
    e = embedding_effect(torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]]), torch.tensor([[2.0, 0.0]] * 3))
    assert e[:2].tolist() == [0.0, 2.0] and math.isnan(e[2])


def test_extra_hooks_run_in_every_pass() -> None:
    model = _encoder(93)
    tokens, mask = _padded(94)
    calls = []

    def scale_v(v, hook):
        calls.append(hook.name)
        return v * 0.5

    res = embedding_curves(
        model, tokens, attention_mask=mask, metrics=["attention", "contribution"], rates=(0.0, 0.5),
        modes=["comprehensiveness"], embedding_fn=pooled, extra_hooks=[(hook_name(0, "v"), scale_v)],
    )  # fmt: skip
    assert len(calls) == 1 + 2  # the clean pass and two masked passes (the edit probe runs without them)
    ref = brute_effects(model, tokens, mask, "attention", "intra", 0.5, "comprehensiveness", [0, 1])
    assert not np.allclose(res.effects[0, 0, 1], ref, atol=1e-6)  # the modified model differs
    assert not has_hooks(model)


def test_bad_input_is_refused_clearly_and_leaves_no_hooks() -> None:
    model = _encoder(95)
    tokens, mask = _padded(96)
    cases = [
        (dict(rates=[1.5]), ValueError, "removal rate"),
        (dict(rates=[-0.1]), ValueError, "removal rate"),
        (dict(rates=[float("nan")]), ValueError, "removal rate"),
        (dict(rates=[]), ValueError, "rates is empty"),
        (dict(metrics=["sparkle"]), ValueError, "unknown intra-head ranking metric"),
        (dict(metrics=["head_share"], scope="inter"), ValueError, "unknown inter-head ranking metric"),
        (dict(modes=["both"]), ValueError, "unknown mode"),
        (dict(scope="global"), ValueError, "unknown scope"),
        (dict(layers=[5]), IndexError, "out of range"),
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(attention_mask=mask[:, :4]), ValueError, "attention_mask"),
        (dict(attention_mask=mask * 2), ValueError, "1 \\(real token\\) and 0"),
        (
            dict(attention_mask=torch.cat([mask[:2], torch.zeros(1, 9, dtype=torch.long)])),
            ValueError,
            "no real",
        ),
    ]
    for kw, err, match in cases:
        kw = {"attention_mask": mask, "embedding_fn": pooled, **kw}
        with pytest.raises(err, match=match):
            embedding_curves(model, tokens, **kw)
        assert not has_hooks(model)

    def broken(model, tokens, attention_mask, *, fwd_hooks=()):
        if any("hook_pattern" in name for name, _ in fwd_hooks if "blocks.1" in name):
            with model.hooks(fwd_hooks=list(fwd_hooks), reset_hooks_end=True):
                raise RuntimeError("boom")
        return pooled(model, tokens, attention_mask, fwd_hooks=fwd_hooks)

    with pytest.raises(RuntimeError, match="boom"):
        embedding_curves(model, tokens, attention_mask=mask, embedding_fn=broken)
    assert not has_hooks(model)
    decoder = make_tiny()
    with pytest.raises(TypeError, match=r"causal decoder.*perplexity_curves"):
        embedding_curves(decoder, random_tokens(2, 6), embedding_fn=pooled)
    assert not has_hooks(decoder)


def test_masking_at_hook_z_matches_the_pattern_masking(monkeypatch) -> None:
    """The fallback for models that discard ``hook_pattern`` edits (a BERT bridge), forced on a model that
    does not: the same curves as the brute-force reference; a wrong recomputed pattern is refused."""
    model = _encoder(100)
    tokens, mask = _padded(101)
    assert ef._masking_path(model, tokens[:1], 0) == "pattern"
    monkeypatch.setattr(ef, "_masking_path", lambda *a: "z")
    rates = (0.0, 0.5, 1.0)
    for scope in ("intra", "inter"):
        res = embedding_curves(
            model, tokens, attention_mask=mask, metrics=["contribution", "random"], rates=rates, scope=scope,
            batch_size=2, embedding_fn=pooled,
        )  # fmt: skip
        for i, metric in enumerate(["contribution", "random"]):
            for j, mode in enumerate(MODES):
                for k, rate in enumerate(rates):
                    ref = brute_effects(model, tokens, mask, metric, scope, rate, mode, [0, 1])
                    np.testing.assert_allclose(res.effects[i, j, k], ref, atol=2e-6, rtol=0)
    assert not has_hooks(model)
    with pytest.raises(ValueError, match="extra_hooks also edit"):
        embedding_curves(
            model,
            tokens,
            attention_mask=mask,
            embedding_fn=pooled,
            extra_hooks=[(hook_name(1, "z"), lambda z, hook: z)],
        )
    init = ef._ZSideMask.__init__

    def wrong_scale(self, *args) -> None:
        init(self, *args)
        self.scale *= 2

    monkeypatch.setattr(ef._ZSideMask, "__init__", wrong_scale)
    with pytest.raises(RuntimeError, match="recomputed from hook_q/hook_k differs"):
        embedding_curves(model, tokens, attention_mask=mask, rates=[0.5], embedding_fn=pooled)
    assert not has_hooks(model)


@pytest.mark.skipif(not HAS_HOOKED, reason="TransformerLens 3.x's bridge discards hook_pattern edits")
def test_a_bridge_that_discards_pattern_edits_is_masked_at_hook_z_or_refused(monkeypatch) -> None:
    bridge = make_tiny(attention_dir="bidirectional", seed=97)
    tokens, mask = _padded(102)
    assert ef._masking_path(bridge, tokens[:1], 0) == "z"
    res = embedding_curves(bridge, tokens, attention_mask=mask, rates=(0.0, 1.0), embedding_fn=pooled)
    assert (res.effects[:, :, 1] > 0).all() and (res.effects[:, :, 0] == 0).all()
    monkeypatch.setattr(ef._ZSideMask, "_edit_z", lambda self, z, hook: z)  # as if hook_z were discarded too
    with pytest.raises(RuntimeError, match=r"ignores edits to blocks\.0\.attn\.hook_pattern and hook_z"):
        embedding_curves(bridge, tokens, attention_mask=mask, embedding_fn=pooled)
    assert not has_hooks(bridge)


def test_default_embedding_is_the_sentence_embedding() -> None:
    from mechgeom.models.encoders import sentence_embedding

    model = _encoder(98)
    tokens, mask = _padded(99)
    kw = dict(attention_mask=mask, metrics=["contribution", "random"], rates=(0.0, 0.5))
    default = embedding_curves(model, tokens, **kw)
    explicit = embedding_curves(model, tokens, embedding_fn=sentence_embedding, **kw)
    assert np.array_equal(default.effects, explicit.effects)
    assert (default.effects[:, :, 1] > 0).all() and (default.effects <= 2).all()
