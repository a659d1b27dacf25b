"""Masking interventions on the real SmolLM2-135M (30 layers x 9 heads, GQA, no b_O)."""

from __future__ import annotations

from functools import partial

import pandas as pd
import pytest
import torch

from mechgeom import hooks as mg_hooks
from mechgeom.analyses import faithfulness
from mechgeom.analyses.faithfulness import curves as fa
from mechgeom.analyses.scoring import perplexity
from mechgeom.data import load_task
from mechgeom.hooks import has_hooks, run_hooks

pytestmark = pytest.mark.integration


def test_smollm2_rate_one_silences_every_attention_layer(smollm2, smollm2_windows) -> None:
    tokens = smollm2_windows[:1, :24]
    ranking = faithfulness.source_rankings(smollm2, tokens, ["attention"])["attention"]
    assert ranking.ranks[0].shape == (1, 9, 24, 24) and ranking.ranks[0].dtype == torch.uint8
    outs: dict[int, torch.Tensor] = {}

    def read(t, hook, layer):
        outs[layer] = t.detach().clone()

    readers = [(f"blocks.{la}.hook_attn_out", partial(read, layer=la)) for la in range(30)]
    clean = run_hooks(smollm2, tokens, readers, return_type="logits")
    assert min(float(o.abs().max()) for o in outs.values()) > 1e-3
    at_zero = run_hooks(
        smollm2, tokens, mg_hooks.masking_hooks(smollm2, ranking=ranking, rate=0.0), return_type="logits"
    )
    assert torch.equal(at_zero, clean)
    run_hooks(smollm2, tokens, [*mg_hooks.masking_hooks(smollm2, ranking=ranking, rate=1.0), *readers])
    assert len(outs) == 30 and all(float(o.abs().max()) == 0.0 for o in outs.values())  # SmolLM2 has no b_O
    assert not has_hooks(smollm2)


def hand_mask(clean: torch.Tensor, num: int, den: int, mode: str) -> torch.Tensor:
    """The masking of docs/definitions.md §3 written out: per (head, query ``i``) rank sources ``j <= i`` by clean attention, largest first,
    ties to the lower position; remove ``ceil(num/den * (i+1))`` (integer ceiling) from the top
    (comprehensiveness) or the bottom (sufficiency). ``clean`` is ``[head, q, k]``; True = removed."""
    mask = torch.zeros(clean.shape, dtype=torch.bool)
    for h in range(clean.shape[0]):
        for i in range(clean.shape[1]):
            order = sorted(range(i + 1), key=lambda j: (-float(clean[h, i, j]), j))
            count = -(-num * (i + 1) // den)
            removed = order[:count] if mode == "comprehensiveness" else order[i + 1 - count :]
            mask[h, i, removed] = True
    return mask


@pytest.mark.parametrize("mode", ["comprehensiveness", "sufficiency"])
def test_smollm2_masked_pattern_matches_hand_mask(smollm2, smollm2_windows, mode) -> None:
    """The library's hook against a mask written here from a plain ``run_with_cache``: ``ceil`` counts, removed
    entries exactly 0, kept entries unchanged (no renormalisation), and the clean ranking reused downstream."""
    tokens, layers, (num, den) = smollm2_windows[:1, :24], [2, 5], (3, 10)
    names = [f"blocks.{la}.attn.hook_pattern" for la in layers]
    with torch.no_grad():
        _, cache = smollm2.run_with_cache(tokens, names_filter=names)
    masks = {la: hand_mask(cache[n][0], num, den, mode) for la, n in zip(layers, names, strict=True)}
    counts = torch.tensor([-(-num * (i + 1) // den) for i in range(24)])
    assert (counts > torch.tensor([num * (i + 1) // den for i in range(24)])).sum() >= 20  # ceil != floor
    for m in masks.values():
        assert torch.equal(m.sum(-1), counts.expand(9, -1))

    ranking = faithfulness.source_rankings(smollm2, tokens, ["attention"], layers=layers)["attention"]
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def read(p, hook, key):  # type: ignore[no-untyped-def]
        seen[key] = p.detach().clone()

    lib = mg_hooks.masking_hooks(smollm2, ranking=ranking, rate=num / den, mode=mode)
    assert [n for n, _ in lib] == names
    hooks = []
    for la, n, fn in zip(layers, names, [f for _, f in lib], strict=True):
        hooks += [(n, partial(read, key=(la, "in"))), (n, fn), (n, partial(read, key=(la, "out")))]
    with torch.no_grad():
        loss = smollm2.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss", loss_per_token=True)
    for la in layers:
        before, after, m = seen[(la, "in")][0], seen[(la, "out")][0], masks[la]
        assert (after[m] == 0).all()
        assert torch.equal(after[~m], before[~m])  # kept attention is not renormalised
        if mode == "comprehensiveness":  # the top source carries >= 1/(i+1): renormalising could not hide
            assert float((before * m).sum(-1).min()) >= 1 / 24 - 1e-6
            assert float(after.sum(-1)[:, 1:].max()) < 0.99
    torch.testing.assert_close(seen[(2, "in")], cache[names[0]], rtol=0, atol=0)  # nothing before layer 2
    # layer 5 sees the masked stream of layer 2 but is masked by its clean ranking (no re-ranking)
    assert not torch.allclose(seen[(5, "in")], cache[names[1]])

    def plain(p, hook, m):  # type: ignore[no-untyped-def]
        return p.masked_fill(m[None], 0.0)

    with torch.no_grad():
        ref = smollm2.run_with_hooks(
            tokens,
            fwd_hooks=[(n, partial(plain, m=masks[la])) for la, n in zip(layers, names, strict=True)],
            return_type="loss",
            loss_per_token=True,
        )
        clean = smollm2(tokens, return_type="loss", loss_per_token=True)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert float((loss - clean).abs().max()) > 1e-2
    assert not has_hooks(smollm2)


def test_smollm2_curves_rank_metrics_above_random(smollm2, smollm2_windows) -> None:
    tokens = smollm2_windows[:2, :64]
    frame = faithfulness.perplexity_curves(
        smollm2,
        tokens,
        ["attention", "contribution", "random"],
        rates=(0.0, 0.3),
        batch_size=2,
        verbose=False,
    )
    clean = perplexity(smollm2, tokens)
    assert frame["clean_ppl"].iloc[0] == pytest.approx(clean, rel=1e-5)
    d = frame.set_index(["metric", "mode", "rate"])["delta_ppl"]
    assert (d.xs(0.0, level="rate") == 0).all()
    # removing the top 30% of each query's sources by a real metric hurts far more than removing 30% at
    # random, and keeping only the top 70% hurts less than keeping a random 70%
    for m in ("attention", "contribution"):
        assert d[(m, "comprehensiveness", 0.3)] > 2 * d[("random", "comprehensiveness", 0.3)] > 0
        assert d[(m, "sufficiency", 0.3)] < d[("random", "sufficiency", 0.3)]


def test_smollm2_task_scoring_uses_the_real_tokenizer(smollm2, tmp_path) -> None:
    items = load_task("mmlu", n=2, seed=0) + load_task("winogrande", n=2, seed=0)
    frame = faithfulness.task_accuracy_curves(
        smollm2,
        items,
        ["contribution"],
        rates=(0.0, 0.5),
        batch_size=4,
        checkpoint=tmp_path / "t.csv",
        verbose=False,
    )
    rec = pd.read_csv(tmp_path / "t.per_choice.csv")
    units, owner = fa._task_units(smollm2, items, int(smollm2.cfg.n_ctx))
    # clean scores by hand: each choice on its own sequence, prompt and choice tokenised apart, no BOS
    correct = []
    u = 0
    for it in items:
        scores = []
        for choice in it.choices:
            ctx = smollm2.to_tokens(it.prompt, prepend_bos=False)[0]
            cont = smollm2.to_tokens(choice, prepend_bos=False)[0]
            seq = torch.cat([ctx, cont])[None]
            logp = run_hooks(smollm2, seq, [], return_type="logits").log_softmax(-1)[0]
            scores.append(sum(float(logp[len(ctx) + k - 1, t]) for k, t in enumerate(cont.tolist())))
            assert owner[u] == (items.index(it), len(scores) - 1)
            mine = rec[(rec.metric == "clean") & (rec.unit_hash == units.hashes[u])].logprob
            assert float(mine.iloc[0]) == pytest.approx(scores[-1], rel=1e-4, abs=1e-3)
            masked = rec[(rec.metric == "contribution") & (rec.unit_hash == units.hashes[u])].logprob
            assert len(masked) == 2 and (masked != mine.iloc[0]).all()
            u += 1
        correct.append(float(max(range(len(scores)), key=lambda c: (scores[c], -c)) == it.answer))
    row = frame[(frame.task == "all") & (frame.rate == 0.0)].iloc[0]
    assert row.clean_accuracy == pytest.approx(sum(correct) / len(correct))
    assert set(frame.task) == {"mmlu", "winogrande", "all"}
