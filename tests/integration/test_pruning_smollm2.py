"""Head pruning on SmolLM2-135M (30 layers x 9 heads, 3 KV heads): exactness of the fast sweep and real properties."""

from __future__ import annotations

import math

import pytest
import torch

from mechgeom.analyses.heads import head_stats, magnitude_order, weight_magnitude
from mechgeom.analyses.heads.pruning import head_ablation_hooks, retention_curve, single_head_sweep
from mechgeom.analyses.scoring import perplexity, score_choices
from mechgeom.data import load_task
from mechgeom.hooks import has_hooks

pytestmark = pytest.mark.integration


def _plain_nll(model, tokens, layer=None, head=None, fill=None):  # type: ignore[no-untyped-def]
    """Per-text mean next-token NLL from plain TransformerLens calls; with ``layer``/``head``, a hook
    written here sets ``z[:, :, head]`` of that layer to ``fill`` (zeros when None) at every position."""

    def remove(z, hook):  # type: ignore[no-untyped-def]
        # z: [batch pos head_index d_head]
        z = z.clone()
        z[:, :, head] = 0.0 if fill is None else fill.to(z.dtype)
        return z

    hooks = [] if layer is None else [(f"blocks.{layer}.attn.hook_z", remove)]
    with torch.no_grad():
        loss = model.run_with_hooks(tokens, return_type="loss", loss_per_token=True, fwd_hooks=hooks)
    return loss.float().mean(dim=-1)


def test_fast_sweep_equals_full_forward(smollm2, smollm2_windows):
    toks = smollm2_windows[:2]
    heads = [(0, 0), (0, 4), (14, 3), (29, 8)]
    fast = single_head_sweep(smollm2, toks, heads=heads, start_at_layer=True)
    torch.testing.assert_close(fast.clean_nll, _plain_nll(smollm2, toks))
    for layer, h in heads:
        full = _plain_nll(smollm2, toks, layer, h)
        torch.testing.assert_close(fast.nll[layer, h], full, atol=1e-4, rtol=1e-5)
        # removing a neighbour of the named head (same layer) gives a different loss: the check is sharp
        other = _plain_nll(smollm2, toks, layer, (h + 1) % 9)
        assert float((fast.nll[layer, h] - other).abs().max()) > 1e-3
    assert torch.isnan(fast.nll[1]).all()  # heads not asked for stay NaN
    assert (fast.delta_ppl[0, 0] != 0).item()
    assert not has_hooks(smollm2)


def test_fast_sweep_mean_mode_equals_full_forward(smollm2, smollm2_windows):
    """Mean ablation: ``z[:, :, h]`` replaced by a mean computed here from a plain cache of other texts."""
    toks, ref = smollm2_windows[:2], smollm2_windows[2:]
    with torch.no_grad():
        _, cache = smollm2.run_with_cache(ref, names_filter=lambda n: n.endswith("attn.hook_z"))
    z_mean = torch.stack([cache[f"blocks.{la}.attn.hook_z"].double().mean(dim=(0, 1)) for la in range(30)])
    assert z_mean.shape == (30, 9, 64)
    z_mean = z_mean.float()
    heads = [(0, 4), (14, 3), (29, 8)]
    for start_at_layer in (True, False):
        fast = single_head_sweep(
            smollm2, toks, heads=heads, mode="mean", means=z_mean, start_at_layer=start_at_layer
        )
        for layer, h in heads:
            full = _plain_nll(smollm2, toks, layer, h, z_mean[layer, h])
            torch.testing.assert_close(fast.nll[layer, h], full, atol=1e-4, rtol=1e-5)
            zeroed = _plain_nll(smollm2, toks, layer, h)
            assert float((fast.nll[layer, h] - zeroed).abs().max()) > 1e-4  # mean is not zero ablation
    assert not has_hooks(smollm2)


def test_weight_magnitude_gqa_smollm2(smollm2):
    # the per-KV-head W_V: HookedTransformer keeps it in attn._W_V (and expands W_V to 9 heads); the
    # TransformerBridge gives W_V per KV head directly
    if hasattr(smollm2, "blocks") and isinstance(getattr(smollm2.blocks[3].attn, "_W_V", None), torch.Tensor):
        assert smollm2.W_V.shape == (30, 9, 576, 64)

        def per_kv(layer):
            return smollm2.blocks[layer].attn._W_V
    else:

        def per_kv(layer):
            return smollm2.W_V[layer]

    assert per_kv(3).shape == (3, 576, 64)
    mags = weight_magnitude(smollm2)
    for layer, h in [(0, 0), (3, 4), (3, 8), (29, 2)]:
        W_V = per_kv(layer)[h // 3]
        ref = torch.linalg.matrix_norm(W_V.double() @ smollm2.blocks[layer].attn.W_O[h].double(), ord="fro")
        assert mags[layer, h].item() == pytest.approx(ref.item(), rel=1e-4)
    # heads sharing a KV head differ only through W_O, so their norms differ
    assert len({round(mags[3, h].item(), 4) for h in range(3)}) == 3


def test_head_stats_and_retention_smollm2(smollm2, smollm2_windows):
    toks = smollm2_windows[:2]
    stats = head_stats(smollm2, smollm2_windows[2:])
    assert stats.z_mean.shape == (30, 9, 64) and stats.n_positions == 2 * 64
    assert (stats.out_norm > 0).all()
    assert (stats.entropy >= 0).all() and (stats.entropy <= math.log(64)).all()
    frame = retention_curve(
        smollm2, magnitude_order(smollm2), {"wikitext2": toks}, name="magnitude", levels=(1.0, 0.5)
    )
    assert frame["n_heads_kept"].tolist() == [270, 135]
    assert frame["ppl"].iloc[0] == pytest.approx(perplexity(smollm2, toks), rel=1e-6)
    assert frame["ppl"].iloc[1] > frame["ppl"].iloc[0]  # removing half the heads hurts
    mean_hooks = head_ablation_hooks(smollm2, [(0, h) for h in range(9)], mode="mean", means=stats)
    zero_hooks = head_ablation_hooks(smollm2, [(0, h) for h in range(9)])
    assert perplexity(smollm2, toks, mean_hooks) != perplexity(smollm2, toks, zero_hooks)


def test_choice_scores_equal_unbatched_smollm2(smollm2):
    items = load_task("winogrande", n=2, seed=1)
    scores = score_choices(smollm2, items, batch_size=4)
    for i, item in enumerate(items):
        prompt = smollm2.to_tokens(item.prompt)[0].tolist()
        for c, choice in enumerate(item.choices):
            cont = smollm2.to_tokens(choice, prepend_bos=False)[0].tolist()
            with torch.no_grad():
                logp = torch.log_softmax(smollm2(torch.tensor([prompt + cont]))[0].double(), dim=-1)
            ref = sum(float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(cont))
            assert scores[i, c].item() == pytest.approx(ref, rel=1e-5)
    assert (scores < 0).all()


def test_head_stats_labels_equal_classify_heads_smollm2(smollm2, smollm2_windows):
    """The taxonomy collected in head_stats' own passes is classify_heads' table; the order starts with Resets."""
    from mechgeom.analyses.heads import head_orders
    from mechgeom.analyses.heads.taxonomy import classify_heads

    ref = smollm2_windows[2:]
    stats = head_stats(smollm2, ref)
    table = stats.taxonomy.to_frame()
    want = classify_heads(smollm2, ref).to_frame()
    assert table[["layer", "head", "label"]].equals(want[["layer", "head", "label"]])
    for col in ("f_cur", "f_sink", "f_other", "sink_rate"):
        assert table[col].to_numpy() == pytest.approx(want[col].to_numpy(), abs=1e-9)
    order = head_orders(smollm2, stats)["taxonomy"]
    labels = dict(zip(zip(table["layer"], table["head"], strict=True), table["label"], strict=True))
    ranks = {"Reset": 0, "Mixer": 1, "Retriever": 2}
    assert [ranks[labels[lh]] for lh in order] == sorted(ranks[labels[lh]] for lh in order)
    assert len(set(table["label"])) >= 2  # a real model has more than one regime
    assert not has_hooks(smollm2)
