"""Padding in every perplexity / log-probability / ΔPPL path (issue 35), on tiny random decoders.

Batches are padded by hand, on the left and on the right, with an ``attention_mask``; each text's numbers
must equal the same text run alone (1e-5 relative, float32), pads are never targets, never ranked among
the sources, never removed, and a masking hook changes nothing at a pad.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from conftest import make_tiny, pooled, random_tokens

from mechgeom import hooks as mg_hooks
from mechgeom.analyses import scoring
from mechgeom.analyses.faithfulness import curves, rankings
from mechgeom.analyses.faithfulness.curves import perplexity_curves
from mechgeom.analyses.faithfulness.rankings import source_rankings
from mechgeom.analyses.scoring import perplexity, target_logprob, text_nll, token_nll
from mechgeom.hooks import has_hooks, masking_hooks, rank_sources, removal_mask, run_hooks

LENGTHS = (10, 6, 3)
POS = 10
SIDES = ("right", "left")


@pytest.fixture(scope="module")
def model():
    return make_tiny(n_kv=2, seed=7)


def texts() -> list[torch.Tensor]:
    """Three texts of different lengths (their token ids)."""
    return [random_tokens(1, n, seed=20 + i)[0] for i, n in enumerate(LENGTHS)]


def padded(side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The texts as one ``[3, POS]`` batch padded by hand on ``side`` with ``pad_id``, and the mask."""
    tokens = torch.full((len(LENGTHS), POS), pad_id, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), POS, dtype=torch.bool)
    for b, t in enumerate(texts()):
        cols = slice(0, len(t)) if side == "right" else slice(POS - len(t), POS)
        tokens[b, cols], mask[b, cols] = t, True
    return tokens, mask


def prediction_targets(mask: torch.Tensor) -> torch.Tensor:
    """Reference: the predictions between two real tokens, written out one by one."""
    b, pos = mask.shape
    return torch.tensor([[bool(mask[r, t] and mask[r, t + 1]) for t in range(pos - 1)] for r in range(b)])


def decoder_source_counts(mask: torch.Tensor) -> torch.Tensor:
    """Reference: each query's real keys ``j <= i`` (0 at a pad), counted one by one."""
    b, pos = mask.shape
    rows = [[int(mask[r, : i + 1].sum()) if mask[r, i] else 0 for i in range(pos)] for r in range(b)]
    return torch.tensor(rows)


def alone_nll(model) -> torch.Tensor:
    """Each text's mean NLL, run alone (no padding anywhere)."""
    return torch.cat([text_nll(model, t[None]) for t in texts()])


# --------------------------------------------------------------------------- the scoring layer


def test_targets_and_source_counts_never_count_a_pad() -> None:
    for side in SIDES:
        _, mask = padded(side)
        tg = scoring.prediction_targets(mask, *mask.shape)
        assert torch.equal(tg, prediction_targets(mask))
        assert tg.sum(-1).tolist() == [n - 1 for n in LENGTHS]
        n = mg_hooks.decoder_source_counts(mask)
        assert torch.equal(n, decoder_source_counts(mask))
        assert n.amax(-1).tolist() == list(LENGTHS)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("pad_id", [0, 7])
def test_text_nll_of_a_padded_batch_equals_each_text_alone(model, side, pad_id) -> None:
    tokens, mask = padded(side, pad_id)
    alone = alone_nll(model)
    for bs in (3, 2):
        got = text_nll(model, tokens, attention_mask=mask, batch_size=bs)
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=0)
    # PPL keeps docs/definitions.md §3.4: exp of the mean over texts of each text's mean NLL
    ppl = perplexity(model, tokens, attention_mask=mask)
    assert ppl == pytest.approx(math.exp(float(alone.mean())), rel=1e-5)
    # the pads are scored as text without the mask: the number differs
    assert not torch.allclose(text_nll(model, tokens), alone, rtol=1e-3)
    assert not has_hooks(model)


@pytest.mark.parametrize("side", SIDES)
def test_token_nll_is_zero_off_target_and_alone_on_target(model, side) -> None:
    tokens, mask = padded(side)
    nll = token_nll(model, tokens, attention_mask=mask)
    tg = prediction_targets(mask)
    assert (nll[~tg] == 0).all()
    for b, t in enumerate(texts()):
        torch.testing.assert_close(nll[b][tg[b]], token_nll(model, t[None])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("side", SIDES)
def test_target_logprob_both_paths_match_the_texts_alone(model, side) -> None:
    """Targets that leave columns out take the unembed-some-positions path on a HookedTransformer."""
    tokens, mask = padded(side)
    full = prediction_targets(mask)
    some = full.clone()
    some[:, :3] = False  # fewer columns: the partial unembedding where the backend has it
    some &= full
    for targets in (full, some):
        got = target_logprob(model, tokens, targets, attention_mask=mask)
        for b, t in enumerate(texts()):
            cols = targets[b].nonzero().flatten() - int((~mask[b]).nonzero().numel() if side == "left" else 0)
            ref = -token_nll(model, t[None])[0][cols].sum()
            assert float(got[b]) == pytest.approx(float(ref), rel=1e-5, abs=1e-6)
    # a target at a pad or predicting one is dropped, whatever the caller marked
    everything = torch.ones_like(full)
    torch.testing.assert_close(
        target_logprob(model, tokens, everything, attention_mask=mask),
        target_logprob(model, tokens, full, attention_mask=mask),
    )


# --------------------------------------------------------------------------- ranking and masking


def test_rank_sources_puts_pads_after_every_real_source_whatever_their_scores() -> None:
    g = torch.Generator().manual_seed(3)
    _, mask = padded("left")
    scores = torch.randn(3, 2, POS, POS, generator=g)
    scores[..., 2, 4] = float("nan")  # a NaN among the real sources ranks below every finite one
    scores.masked_fill_(~mask[:, None, None, :], 1e9)  # pads score highest: they must still rank last
    ranks = rank_sources(scores, key_mask=mask)
    n = decoder_source_counts(mask)
    for b, t in enumerate(texts()):
        off = POS - len(t)
        alone = rank_sources(scores[b : b + 1, :, off:, off:])[0]
        src = torch.ones(len(t), len(t), dtype=torch.bool).tril()  # the sources j <= i of the text
        assert torch.equal(ranks[b][:, off:, off:][:, src], alone[:, src])
        # a real query's pads come right after its real sources
        for i in range(off, POS):
            assert sorted(ranks[b, 0, i, :off].tolist()) == list(range(int(n[b, i]), int(n[b, i]) + off))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("mode", ["comprehensiveness", "sufficiency"])
def test_removal_never_touches_a_pad(side, mode) -> None:
    g = torch.Generator().manual_seed(4)
    _, mask = padded(side)
    scores = torch.randn(3, 4, POS, POS, generator=g).masked_fill(~mask[:, None, None, :], 1e9)
    ranks = rank_sources(scores, key_mask=mask)
    n = decoder_source_counts(mask)
    for rate in (0.1, 0.5, 0.9, 1.0):
        rm = removal_mask(ranks, rate, mode, n)  # [b, h, q, k]
        assert not rm.permute(0, 3, 1, 2)[~mask].any()  # never a padded key
        assert not rm.permute(0, 2, 1, 3)[~mask].any()  # never at a padded query
        for b in range(len(LENGTHS)):
            cols = mask[b].nonzero().flatten()
            alone = removal_mask(rank_sources(scores[b : b + 1][..., cols[:, None], cols]), rate, mode)
            assert torch.equal(rm[b][:, cols[:, None], cols], alone[0])


@pytest.mark.parametrize("side", SIDES)
def test_masking_hooks_of_a_padded_ranking_leave_pads_alone(model, side) -> None:
    """source_rankings of a padded batch carries n_sources; masking_hooks uses it by default: at rate 1
    every real source of every real query goes, and the pattern at pads is the clean one."""
    tokens, mask = padded(side)
    ranking = source_rankings(model, tokens, ["attention"], attention_mask=mask)["attention"]
    assert ranking.n_sources is not None and torch.equal(ranking.n_sources.cpu(), decoder_source_counts(mask))
    seen: dict[str, torch.Tensor] = {}

    def read(p, hook):
        seen[hook.name] = p.detach().clone()

    name = "blocks.1.attn.hook_pattern"
    run_hooks(model, tokens, [(name, read)], attention_mask=mask)
    clean = seen.pop(name)
    hooks = masking_hooks(model, ranking=ranking, rate=1.0, layers=[1])  # layer 0 as clean: same inputs
    run_hooks(model, tokens, [*hooks, (name, read)], attention_mask=mask)
    masked = seen.pop(name)
    real_pair = mask[:, None, :, None] & mask[:, None, None, :]
    assert (masked[real_pair.expand_as(masked)] == 0).all()  # every real source of a real query removed
    at_pad = ~real_pair.expand_as(masked)
    torch.testing.assert_close(masked[at_pad], clean[at_pad], rtol=0, atol=0)  # nothing changed at a pad
    assert not has_hooks(model)


# --------------------------------------------------------------------------- the ΔPPL sweep

SWEEP = dict(
    metrics=["attention", "contribution", "random", "rollout"],
    rates=[0.0, 0.6],
    n_boot=10,
    per_text=True,
)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_perplexity_curves_of_a_padded_batch_equal_each_text_alone(model, side, scope) -> None:
    tokens, mask = padded(side, pad_id=5)
    batched = perplexity_curves(model, tokens, attention_mask=mask, scope=scope, batch_size=2, **SWEEP)
    assert len(batched) == len(LENGTHS) * 4 * 2 * 2
    for b, t in enumerate(texts()):
        alone = perplexity_curves(model, t[None], scope=scope, **SWEEP).reset_index(drop=True)
        mine = batched[batched["text"] == b].reset_index(drop=True)
        assert (mine["n_pred"] == LENGTHS[b] - 1).all()
        assert (mine["unit_hash"] == alone["unit_hash"]).all()
        np.testing.assert_allclose(mine["clean_ppl"], alone["clean_ppl"], rtol=1e-5)
        np.testing.assert_allclose(mine["ppl"], alone["ppl"], rtol=1e-5)
    # the table pools the texts as their runs alone do (docs/definitions.md §3.4)
    table = perplexity_curves(model, tokens, attention_mask=mask, scope=scope, **{**SWEEP, "per_text": False})
    clean = batched[(batched["rate"] == 0) & (batched["metric"] == "attention")]
    clean = clean[clean["mode"] == "comprehensiveness"]
    assert table["clean_ppl"].iloc[0] == pytest.approx(math.exp(clean["clean_nll"].mean()), rel=1e-9)
    alone_clean = math.exp(float(alone_nll(model).mean()))
    assert table["clean_ppl"].iloc[0] == pytest.approx(alone_clean, rel=1e-5)
    assert not has_hooks(model)


def test_left_and_right_padding_give_the_same_curves(model) -> None:
    runs = [perplexity_curves(model, *[padded(s)[0]], attention_mask=padded(s)[1], **SWEEP) for s in SIDES]
    np.testing.assert_allclose(runs[0]["ppl"], runs[1]["ppl"], rtol=1e-5)


def test_a_mask_with_a_hole_is_refused(model) -> None:
    tokens, mask = padded("right")
    mask[0, 4] = False
    with pytest.raises(ValueError, match=r"text\(s\) \[0\].*contiguous"):
        perplexity_curves(model, tokens, attention_mask=mask, **SWEEP)


def test_attention_mask_is_keyword_only_everywhere() -> None:
    for fn in (perplexity_curves, source_rankings, text_nll, token_nll, target_logprob, perplexity):
        param = inspect.signature(fn).parameters["attention_mask"]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None, fn.__name__
    assert curves.perplexity_curves is perplexity_curves and rankings.source_rankings is source_rankings


# --------------------------------------------------------------------------- an encoder's embedding curves


@pytest.mark.parametrize("side", SIDES)
def test_embedding_curves_of_a_padded_batch_equal_each_text_alone(side) -> None:
    """An encoder's positions are absolute: a left-padded text must still be read from position 0."""
    from conftest import HAS_HOOKED, make_hooked_encoder

    from mechgeom.analyses.faithfulness.embedding import embedding_curves

    model = make_hooked_encoder(5) if HAS_HOOKED else make_tiny(attention_dir="bidirectional", seed=5)
    tokens, mask = padded(side, pad_id=0)
    kw = dict(metrics=["attention", "random"], rates=[0.5, 1.0], embedding_fn=pooled, n_boot=5)
    batched = embedding_curves(model, tokens, attention_mask=mask.long(), **kw)
    assert batched.n_tokens == list(LENGTHS)
    for b, t in enumerate(texts()):
        alone = embedding_curves(model, t[None], **kw)
        assert alone.unit_hashes == [batched.unit_hashes[b]]
        np.testing.assert_allclose(batched.effects[..., b], alone.effects[..., 0], rtol=1e-5, atol=1e-6)
    assert float(np.abs(batched.effects).max()) > 1e-3  # the removal does something
    assert not has_hooks(model)


# --------------------------------------------------------------------------- pruning's evaluation passes


@pytest.mark.parametrize("side", SIDES)
def test_single_head_sweep_of_a_padded_batch_equals_each_text_alone(model, side, tmp_path) -> None:
    from mechgeom.analyses.heads.pruning import single_head_sweep, sweep_exactness

    tokens, mask = padded(side)
    heads = [(0, 1), (1, 0), (1, 3)]
    ckpt = tmp_path / "sweep.csv"
    batched = single_head_sweep(
        model, tokens, attention_mask=mask, heads=heads, batch_size=2, checkpoint=ckpt
    )
    torch.testing.assert_close(batched.clean_nll, alone_nll(model), rtol=1e-5, atol=0)
    for b, t in enumerate(texts()):
        alone = single_head_sweep(model, t[None], heads=heads)
        for lh in heads:
            assert float(batched.nll[lh][b]) == pytest.approx(float(alone.nll[lh][0]), rel=1e-5)
    gap = sweep_exactness(model, tokens, batched, heads, attention_mask=mask)["max_abs_nll_gap"]
    assert gap < 1e-5
    # the mask is in the checkpoint's fingerprint: the same ids read without it are other numbers
    with pytest.raises(ValueError, match="tokens"):
        single_head_sweep(model, tokens, heads=heads, checkpoint=ckpt)


@pytest.mark.parametrize("side", SIDES)
def test_retention_curve_of_a_padded_corpus_pools_each_text_as_alone(model, side) -> None:
    from mechgeom.analyses.heads.pruning import retention_curve

    tokens, mask = padded(side)
    order = [(la, h) for la in range(2) for h in range(4)]
    frame = retention_curve(model, order, {"c": tokens}, levels=[1.0, 0.5], attention_mask={"c": mask})
    clean = frame[frame["retention"] == 1.0]
    assert float(clean["nll"].iloc[0]) == pytest.approx(float(alone_nll(model).mean()), rel=1e-5)
    half = frame[frame["retention"] == 0.5]
    removed = order[:4]
    from mechgeom.hooks import head_ablation_hooks

    hooks = head_ablation_hooks(model, removed)
    ref = torch.cat([text_nll(model, t[None], hooks) for t in texts()]).mean()
    assert float(half["nll"].iloc[0]) == pytest.approx(float(ref), rel=1e-5)


# --------------------------------------------------------------------------- the sink ablation's passes


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("mode", ["zero", "mean_norm"])
def test_sink_ablation_of_a_padded_batch_equals_each_text_alone(model, side, mode) -> None:
    """Position 0 is each text's first real token; pads are never targets, ablated, references of
    "mean_norm", queries of the means over Q, nor keys of the cone direction."""
    from mechgeom.analyses.sinks.ablation import sink_ablation

    tokens, mask = padded(side, pad_id=3)
    kw = dict(layers=[0, 1], heads=[0, 2], mode=mode, scale=0.5, sink_positions=[0, 1], batch_size=2)
    batched = sink_ablation(model, tokens, attention_mask=mask, **kw)
    assert batched.attention_mask is not None
    lengths = batched.attention_mask.sum(-1).tolist()
    assert lengths == list(LENGTHS) and all(
        1 < int(c) < n for c, n in zip(batched.control_positions, LENGTHS, strict=True)
    )
    for b, t in enumerate(texts()):
        alone = sink_ablation(model, t[None], **kw)
        for cond in ("clean", "sink"):
            assert float(batched.nll[cond][b]) == pytest.approx(float(alone.nll[cond][0]), rel=1e-5)
            torch.testing.assert_close(
                batched.out_norm[cond][b], alone.out_norm[cond][0], rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(
                batched.cone_cos[cond][b], alone.cone_cos[cond][0], rtol=1e-5, atol=1e-5
            )
    assert float((batched.nll["sink"] - batched.nll["clean"]).abs().max()) > 1e-4  # the ablation acts
    assert not has_hooks(model)


@pytest.mark.parametrize("side", SIDES)
def test_ranking_table_of_a_padded_batch_has_only_real_pairs(model, side) -> None:
    tokens, mask = padded(side)
    ranking = source_rankings(model, tokens, ["attention"], attention_mask=mask)["attention"]
    frame = ranking.to_frame(layer=0)
    for b, n in enumerate(LENGTHS):
        rows = frame[frame["batch"] == b]
        assert len(rows) == 4 * n * (n + 1) // 2  # 4 heads x the text's own (query, key <= query) pairs
        assert mask[b, rows["query"].to_numpy()].all() and mask[b, rows["key"].to_numpy()].all()
