"""Head pruning on tiny random models: every quantity against a brute-force reference built here."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import statistics

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, needs_hooked, random_tokens
from hypothesis import given, settings, strategies as st

import mechgeom.analyses.heads.pruning as pruning
from mechgeom.analyses import heads
from mechgeom.analyses.heads import (
    entropy_order,
    head_stats,
    magnitude_order,
    random_order,
    taxonomy_order,
    weight_magnitude,
)
from mechgeom.analyses.heads.pruning import (
    SingleHeadResult,
    head_ablation_hooks,
    mad_outliers,
    retention_curve,
    retention_curves,
    retention_levels,
    single_head_sweep,
    task_accuracy,
)
from mechgeom.analyses.heads.taxonomy import classify_heads
from mechgeom.analyses.scoring import perplexity, score_choices, text_nll
from mechgeom.data import TaskItem
from mechgeom.hooks import has_hooks
from mechgeom.viz import plot_retention

#: docs/definitions.md §7.3: Reset heads are removed first, then Mixers, Retrievers last.
REGIMES = ("Reset", "Mixer", "Retriever")


def _bruteforce_attn_out(cache, model, layer: int, removed: set[int], fill=None) -> torch.Tensor:
    """hook_attn_out rebuilt with loops: z[b,i,h] = sum_j alpha v (GQA-expanded), summed over kept heads + b_O."""
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"]  # [b h q k]
    v = cache[f"blocks.{layer}.attn.hook_v"]  # [b pos kv d_head]
    n_heads, group = model.cfg.n_heads, model.cfg.n_heads // v.shape[2]
    W_O, b_O = model.blocks[layer].attn.W_O, model.blocks[layer].attn.b_O
    batch, pos = pattern.shape[0], pattern.shape[2]
    out = torch.zeros(batch, pos, model.cfg.d_model)
    for b in range(batch):
        for i in range(pos):
            acc = b_O.clone()
            for h in range(n_heads):
                if h in removed:
                    if fill is not None:
                        acc = acc + fill[h] @ W_O[h]
                    continue
                z = sum(pattern[b, h, i, j] * v[b, j, h // group] for j in range(i + 1))
                acc = acc + z @ W_O[h]
            out[b, i] = acc
    return out


# --------------------------------------------------------------------------- removal hooks


@pytest.mark.parametrize("n_kv", [None, 2])
def test_pruning_nothing_is_identity(n_kv):
    model = make_tiny(n_kv=n_kv)
    toks = random_tokens(2, 10)
    assert head_ablation_hooks(model, []) == []
    clean = model(toks)
    with model.hooks(fwd_hooks=head_ablation_hooks(model, [])):
        same = model(toks)
    assert torch.equal(clean, same)
    # and a real removal changes the logits (so the comparison above could fail)
    with model.hooks(fwd_hooks=head_ablation_hooks(model, [(0, 1)])):
        assert not torch.allclose(clean, model(toks))


@pytest.mark.parametrize("n_kv", [None, 2])
def test_zero_ablation_equals_bruteforce_attn_out(n_kv):
    model = make_tiny(n_kv=n_kv, b_O=True)
    toks = random_tokens(2, 7, seed=3)
    removed = {0: {1, 3}, 1: {0}}
    hooks = head_ablation_hooks(model, [(0, 1), (1, 0), (0, 3)])
    assert [name for name, _ in hooks] == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        _, cache = model.run_with_cache(toks)
    assert not has_hooks(model)
    for layer in (0, 1):
        ref = _bruteforce_attn_out(cache, model, layer, removed[layer])
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_attn_out"], ref, atol=1e-5, rtol=1e-5)
        # the cached z (taken after the ablation hook) is zero exactly on the removed heads
        z = cache[f"blocks.{layer}.attn.hook_z"]
        for h in range(model.cfg.n_heads):
            assert (z[:, :, h] == 0).all().item() == (h in removed[layer])


def test_mean_ablation_uses_reference_mean():
    model = make_tiny(n_kv=2)
    ref = random_tokens(3, 9, seed=11)
    toks = random_tokens(2, 6, seed=12)
    _, ref_cache = model.run_with_cache(ref)
    for start_pos in (0, 2):
        stats = head_stats(model, ref, start_pos=start_pos, batch_size=2)
        assert stats.n_positions == 3 * (9 - start_pos)
        for layer in range(model.cfg.n_layers):
            z = ref_cache[f"blocks.{layer}.attn.hook_z"]
            for h in range(model.cfg.n_heads):
                rows = [z[b, i, h] for b in range(3) for i in range(start_pos, 9)]
                torch.testing.assert_close(
                    stats.z_mean[layer, h], torch.stack(rows).mean(0), atol=1e-6, rtol=1e-5
                )
    stats = head_stats(model, ref)
    hooks = head_ablation_hooks(model, [(0, 2), (1, 1)], mode="mean", means=stats)
    _, clean_cache = model.run_with_cache(toks)
    with torch.no_grad(), model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        _, cache = model.run_with_cache(toks)
    z0 = cache["blocks.0.attn.hook_z"]
    assert torch.equal(z0[:, :, 2], stats.z_mean[0, 2].expand(2, 6, -1))
    assert torch.equal(cache["blocks.1.attn.hook_z"][:, :, 1], stats.z_mean[1, 1].expand(2, 6, -1))
    torch.testing.assert_close(z0[:, :, [0, 1, 3]], clean_cache["blocks.0.attn.hook_z"][:, :, [0, 1, 3]])
    ref_out = _bruteforce_attn_out(cache, model, 0, {2}, fill={2: stats.z_mean[0, 2]})
    torch.testing.assert_close(cache["blocks.0.hook_attn_out"], ref_out, atol=1e-5, rtol=1e-5)


def test_invalid_heads_raise():
    model = make_tiny()
    with pytest.raises(ValueError, match="duplicate"):
        head_ablation_hooks(model, [(0, 1), (1, 1), (0, 1)])
    with pytest.raises(IndexError):
        head_ablation_hooks(model, [(2, 0)])
    with pytest.raises(IndexError):
        head_ablation_hooks(model, [(0, 4)])
    with pytest.raises(IndexError):
        head_ablation_hooks(model, [(-1, 0)])
    with pytest.raises(ValueError, match="means"):
        head_ablation_hooks(model, [(0, 0)], mode="mean")
    with pytest.raises(ValueError, match="shape"):
        head_ablation_hooks(model, [(0, 0)], mode="mean", means=torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="mode"):
        head_ablation_hooks(model, [(0, 0)], mode="half")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="all 8 heads"):
        retention_curve(model, [(0, 0)], {"x": random_tokens()})


def test_no_hooks_left_after_exception(monkeypatch):
    model = make_tiny()
    toks = random_tokens(2, 8)

    def boom(tensor, hook):
        raise RuntimeError("boom")

    order = random_order(model, 0)
    with pytest.raises(RuntimeError, match="boom"):
        retention_curve(
            model, order, {"x": toks}, levels=(0.5,), extra_hooks=[("blocks.1.attn.hook_z", boom)]
        )
    assert not has_hooks(model)

    def bad_entropy(pattern):
        raise RuntimeError("entropy failed")

    # head_stats lives in mechgeom.analyses.heads.stats (re-exported by pruning): patch it where it is called
    monkeypatch.setattr(
        importlib.import_module("mechgeom.analyses.heads.stats"), "pattern_entropy", bad_entropy
    )
    with pytest.raises(RuntimeError, match="entropy failed"):
        head_stats(model, toks)
    assert not has_hooks(model)
    monkeypatch.undo()

    def bad_replace(z, hook, **kwargs):
        raise RuntimeError("ablation failed")

    import mechgeom.hooks.interventions as interventions

    monkeypatch.setattr(interventions, "replace_z_hook", bad_replace)  # the hook head_ablation_hooks builds
    for start_at_layer in (True, False):
        with pytest.raises(RuntimeError, match="ablation failed"):
            single_head_sweep(model, toks, heads=[(1, 2)], start_at_layer=start_at_layer)
        assert not has_hooks(model)


def test_removal_composes_with_transformer_lens_patching_and_the_collector():
    """Head removal under ``model.hooks`` stays active inside ``transformer_lens.patching`` sweeps, and a
    contribution collector beside it sees the ablated ``z``; nothing is left attached afterwards."""
    from transformer_lens import patching

    from mechgeom import ContributionCollector, contribution_weights

    model = make_tiny(n_kv=2, b_O=True, seed=21)
    clean, corrupted = random_tokens(2, 7, seed=22), random_tokens(2, 7, seed=23)
    _, clean_cache = model.run_with_cache(clean)
    removed = [(0, 1), (1, 3)]

    def metric(logits):
        return logits[:, -1, 5].mean()

    with torch.no_grad(), model.hooks(fwd_hooks=head_ablation_hooks(model, removed)):
        got = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
        assert has_hooks(model)  # the sweep's own hooks went, ours stayed
    assert not has_hooks(model)

    # brute force: the removal hooks first, then a hand-written patch of one head's z
    def patch(z, hook, head):
        z = z.clone()
        z[:, :, head] = clean_cache[hook.name][:, :, head]
        return z

    want = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)
    for layer, head in itertools.product(range(model.cfg.n_layers), range(model.cfg.n_heads)):
        hooks = [
            *head_ablation_hooks(model, removed),
            (f"blocks.{layer}.attn.hook_z", lambda z, hook, h=head: patch(z, hook, h)),
        ]
        with torch.no_grad():
            want[layer, head] = metric(model.run_with_hooks(corrupted, fwd_hooks=hooks))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        plain = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    assert not torch.allclose(plain, got)  # the removal mattered, so the comparison above could fail

    col = ContributionCollector(model, layers=[0], intra=["contribution"], inter=[])
    with torch.no_grad():
        model.run_with_hooks(corrupted, fwd_hooks=[*head_ablation_hooks(model, removed), *col.fwd_hooks])
    assert not has_hooks(model)
    res = col.result(corrupted).intra["contribution"][:, 0]  # [b h q k]
    ref = contribution_weights(model, corrupted, layers=[0]).intra["contribution"][:, 0]
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    assert torch.isnan(
        res[:, 1][:, causal]
    ).all()  # the removed head's output is zero: NaN rows, as documented
    keep = [0, 2, 3]
    torch.testing.assert_close(
        res[:, keep], ref[:, keep], equal_nan=True
    )  # other heads of the layer untouched


# --------------------------------------------------------------------------- statistics and orders


def test_head_stats_norm_and_entropy_bruteforce():
    model = make_tiny(n_kv=2, n_layers=2)
    toks = random_tokens(2, 6, seed=5)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    stats = head_stats(model, toks, batch_size=1)
    for layer in range(2):
        z, pattern = cache[f"blocks.{layer}.attn.hook_z"], cache[f"blocks.{layer}.attn.hook_pattern"]
        W_O = model.blocks[layer].attn.W_O.detach()
        for h in range(model.cfg.n_heads):
            norms, ents = [], []
            for b in range(2):
                for i in range(6):
                    norms.append(float(torch.linalg.vector_norm(z[b, i, h] @ W_O[h])))
                    ents.append(
                        -sum(float(p) * math.log(float(p)) for p in pattern[b, h, i, : i + 1] if p > 0)
                    )
            assert stats.out_norm[layer, h].item() == pytest.approx(np.mean(norms), rel=1e-5)
            assert stats.entropy[layer, h].item() == pytest.approx(np.mean(ents), rel=1e-5, abs=1e-7)
    frame = stats.to_frame()
    assert list(frame.columns) == ["layer", "head", "out_norm", "entropy"] and len(frame) == 8


@needs_hooked  # reads HookedTransformer's per-KV-head attn._W_V
def test_weight_magnitude_order_on_gqa():
    model = make_tiny(n_kv=2, n_heads=4, n_layers=3, seed=7)
    attn = model.blocks[0].attn
    assert attn._W_V.shape[0] == 2 and model.W_V.shape[1] == 4  # GQA: per-KV storage, expanded property
    ref = {}
    for layer in range(3):
        W_V, W_O = model.blocks[layer].attn._W_V.detach(), model.blocks[layer].attn.W_O.detach()
        for h in range(4):
            ref[(layer, h)] = float(torch.linalg.matrix_norm(W_V[h // 2] @ W_O[h], ord="fro"))
    mags = weight_magnitude(model)
    for (layer, h), val in ref.items():
        assert mags[layer, h].item() == pytest.approx(val, rel=1e-5)
    assert magnitude_order(model) == sorted(ref, key=lambda lh: (ref[lh], lh))


def test_entropy_order_direction():
    ent = torch.tensor([[0.5, 2.0, 1.0], [0.1, 2.0, 3.0]])
    high = entropy_order(ent)
    assert high == [(1, 2), (0, 1), (1, 1), (0, 2), (0, 0), (1, 0)]  # ties (2.0) by (layer, head)
    assert [ent[lh].item() for lh in entropy_order(ent, highest_first=False)] == sorted(
        ent.flatten().tolist()
    )
    with pytest.raises(ValueError, match="NaN"):
        entropy_order(torch.tensor([[float("nan"), 1.0]]))


def test_random_order_seeded():
    model = make_tiny(n_layers=3, n_heads=4)
    a, b, c = random_order(model, 0), random_order(model, 0), random_order(model, 1)
    assert a == b
    assert a != c
    assert sorted(a) == sorted(c) == [(layer, h) for layer in range(3) for h in range(4)]


def _check_taxonomy_order(table: pd.DataFrame, order: list[tuple[int, int]]) -> None:
    assert sorted(order) == sorted(zip(table["layer"], table["head"], strict=True))
    info = {(r.layer, r.head): (REGIMES.index(r.label), r.out_norm) for r in table.itertuples()}
    keys = [info[lh] for lh in order]
    for prev, nxt in itertools.pairwise(keys):
        assert prev[0] <= nxt[0]  # Reset -> Mixer -> Retriever
        if prev[0] == nxt[0]:
            assert prev[1] <= nxt[1]  # ascending norm inside a regime


def test_taxonomy_order_handmade_table():
    table = pd.DataFrame(
        {
            "layer": [0, 0, 0, 1, 1, 1, 2, 2],
            "head": [0, 1, 2, 0, 1, 2, 0, 1],
            "label": ["Retriever", "Mixer", "Reset", "Mixer", "Reset", "Mixer", "Retriever", "Reset"],
            "out_norm": [0.1, 3.0, 2.0, 1.0, 0.5, 2.5, 0.05, 4.0],
        }
    )
    order = taxonomy_order(table)
    _check_taxonomy_order(table, order)
    assert order[0] == (1, 1) and order[-1] == (0, 0)
    # norms given as a [layer, head] tensor override the column
    norms = torch.zeros(3, 3)
    norms[1, 1], norms[0, 2], norms[2, 1] = 9.0, 1.0, 5.0
    assert taxonomy_order(table.drop(columns="out_norm"), norms)[:3] == [(0, 2), (2, 1), (1, 1)]
    with pytest.raises(ValueError, match="unknown taxonomy label"):
        taxonomy_order(table.assign(label=["Sink", *table["label"][1:]]))
    with pytest.raises(ValueError, match="column"):
        taxonomy_order(table.drop(columns="label"))
    with pytest.raises(ValueError, match="out_norm"):
        taxonomy_order(table.drop(columns="out_norm"))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(REGIMES), st.floats(0, 10, allow_nan=False)), min_size=1, max_size=24)
)
def test_taxonomy_order_property(rows):
    table = pd.DataFrame(
        {
            "layer": [k // 4 for k in range(len(rows))],
            "head": [k % 4 for k in range(len(rows))],
            "label": [r[0] for r in rows],
            "out_norm": [r[1] for r in rows],
        }
    )
    _check_taxonomy_order(table, taxonomy_order(table))


# --------------------------------------------------------------------------- critical heads


def test_mad_outliers_against_statistics_module():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(1.0, 0.2, 60), [9.0, 2.5]])
    out = mad_outliers(x, k=5)
    med = statistics.median(x.tolist())
    mad = 1.4826 * statistics.median([abs(v - med) for v in x.tolist()])
    assert out["median"] == pytest.approx(med) and out["mad"] == pytest.approx(mad)
    assert out["threshold"] == pytest.approx(med + 5 * mad)
    assert out["flags"].tolist() == [v > med + 5 * mad for v in x.tolist()]
    assert out["flags"][-2] and out["flags"].sum() >= 1
    assert not mad_outliers(rng.normal(0, 1, 50))["flags"].any()


def test_single_head_leaderboard_frame():
    clean = torch.tensor([1.0, 1.2])
    nll = torch.tensor([[[1.01, 1.21], [1.02, 1.22]], [[3.0, 3.5], [1.0, 1.21]], [[1.03, 1.19], [1.02, 1.2]]])
    res = SingleHeadResult(clean_nll=clean, nll=nll)
    df = res.to_frame(k=5)
    assert df["rank"].tolist() == list(range(1, 7))
    assert df["delta_ppl"].is_monotonic_decreasing
    assert (df.loc[0, "layer"], df.loc[0, "head"]) == (1, 0)
    expected = math.exp(3.25) - math.exp(1.1)
    assert df.loc[0, "delta_ppl"] == pytest.approx(expected, rel=1e-5)
    assert res.critical(k=5)[["layer", "head"]].values.tolist() == [[1, 0]]
    assert heads.single_head_order(res)[-1] == (1, 0)


# --------------------------------------------------------------------------- sweep


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_sweep_start_at_layer_equals_full_forward(mode):
    model = make_tiny(n_layers=3, n_kv=2, seed=2)
    toks = random_tokens(3, 10, seed=4)
    means = head_stats(model, random_tokens(2, 10, seed=9)) if mode == "mean" else None
    fast = single_head_sweep(model, toks, mode=mode, means=means, batch_size=2, start_at_layer=True)
    slow = single_head_sweep(model, toks, mode=mode, means=means, batch_size=2, start_at_layer=False)
    torch.testing.assert_close(fast.nll, slow.nll, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.clean_nll, text_nll(model, toks))
    for layer, h in [(0, 0), (2, 3)]:
        hooks = head_ablation_hooks(model, [(layer, h)], mode=mode, means=means)
        torch.testing.assert_close(fast.nll[layer, h], text_nll(model, toks, hooks), atol=1e-5, rtol=1e-5)
    assert not torch.isnan(fast.nll).any()
    assert (fast.delta_ppl != 0).any()


@pytest.mark.parametrize(("batch_size", "start_at_layer"), [(1, True), (3, False), (2, True)])
def test_batched_removal_equals_each_head_removed_alone(batch_size, start_at_layer):
    # heads of a layer share forwards in copies of the batch (head_removal); every head, every text, against
    # one plain forward per head with only that head's removal hook; batch_size=1 splits 4 heads into 2 runs
    model = make_tiny(n_layers=2, n_kv=2, seed=8)
    toks = random_tokens(3, 9, seed=5)
    sweep = single_head_sweep(model, toks, batch_size=batch_size, start_at_layer=start_at_layer)
    for layer, h in itertools.product(range(2), range(4)):
        alone = text_nll(model, toks, head_ablation_hooks(model, [(layer, h)]))
        torch.testing.assert_close(sweep.nll[layer, h], alone, atol=1e-5, rtol=1e-5)
    assert not has_hooks(model)


def test_head_chunks_cover_every_head_once_within_the_budget():
    from mechgeom.analyses.heads.removal import head_chunks

    for n_heads, n_texts, max_seqs in itertools.product(range(0, 10), range(1, 6), range(1, 20)):
        chunks = head_chunks(n_heads, n_texts, max_seqs)
        assert [h for c in chunks for h in range(c.start, c.stop)] == list(range(n_heads))
        assert all(c.stop - c.start >= 1 for c in chunks)
        assert all((c.stop - c.start) * n_texts <= max(max_seqs, n_texts) for c in chunks)
        per = max(1, max_seqs // n_texts)
        assert len(chunks) == math.ceil(n_heads / per)  # as few forwards as the budget allows


@needs_hooked  # counts calls of the start_at_layer path, which only a HookedTransformer takes
def test_sweep_checkpoint_resumes(tmp_path, monkeypatch):
    model = make_tiny(n_layers=2, seed=3)
    toks = random_tokens(2, 8, seed=1)
    ckpt = tmp_path / "sweep.csv"
    single_head_sweep(model, toks, heads=[(0, 0), (0, 2)], checkpoint=ckpt)
    calls = []
    real = pruning._nll_from_layer
    copies = lambda *a, **k: calls.append((a[3], a[1].shape[0] // 2)) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(pruning, "_nll_from_layer", copies)
    resumed = single_head_sweep(model, toks, checkpoint=ckpt)
    # one forward per layer, one copy of the 2 texts per head: the two heads on file are not recomputed
    assert calls == [(0, 2), (1, 4)]
    fresh = single_head_sweep(model, toks)
    torch.testing.assert_close(resumed.nll, fresh.nll, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="checkpoint"):
        single_head_sweep(model, random_tokens(2, 8, seed=2), checkpoint=ckpt)


# --------------------------------------------------------------------------- retention


@pytest.mark.parametrize("n", [270, 72, 9, 7, 1])
def test_retention_levels_round_half_up(n):
    levels = retention_levels(n)
    assert [r for r, _ in levels] == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    assert levels[0][1] == n
    kept = [k for _, k in levels]
    assert kept == sorted(kept, reverse=True)
    for r, k in levels:
        exact = r * n
        assert abs(k - exact) <= 0.5 + 1e-9
        if abs(exact - round(exact) - 0.5) < 1e-9 or abs(exact - math.floor(exact) - 0.5) < 1e-9:
            assert k == math.floor(exact) + 1  # ties go up
    assert retention_levels(9, [0.5])[0][1] == 5


def test_retention_curve_matches_direct_perplexity(tmp_path, monkeypatch):
    model = make_tiny(n_layers=2, seed=5)
    corpora = {"a": random_tokens(2, 10, seed=1), "b": random_tokens(3, 8, seed=2)}
    order = random_order(model, 3)
    frame = retention_curve(model, order, corpora, name="random", levels=(1.0, 0.5, 0.2))
    assert set(frame.columns) >= {
        "order",
        "retention",
        "n_heads_kept",
        "corpus",
        "ppl",
        "delta_ppl",
        "accuracy",
    }
    for row in frame.itertuples():
        removed = order[: 8 - row.n_heads_kept]
        direct = perplexity(model, corpora[row.corpus], head_ablation_hooks(model, removed))
        assert row.ppl == pytest.approx(direct, rel=1e-5)
        assert row.delta_ppl == pytest.approx(
            direct - perplexity(model, corpora[row.corpus]), rel=1e-4, abs=1e-6
        )
    assert frame["n_heads_kept"].tolist() == [8, 8, 4, 4, 2, 2]
    assert (frame.loc[frame["retention"] == 1.0, "delta_ppl"] == 0).all()

    ckpt = tmp_path / "curves.csv"
    orders = {"random": order, "magnitude": magnitude_order(model)}
    first = retention_curves(model, orders, corpora, levels=(1.0, 0.5), checkpoint=ckpt)
    assert first.to_frame()["order"].unique().tolist() == ["random", "magnitude"]
    monkeypatch.setattr(pruning, "retention_curve", lambda *a, **k: pytest.fail("finished order recomputed"))
    again = retention_curves(model, orders, corpora, levels=(1.0, 0.5), checkpoint=ckpt)
    pd.testing.assert_frame_equal(again.to_frame(), first.to_frame(), check_dtype=False)
    summary = first.summary_frame()  # the table that summary() returned before it became a dict
    assert len(summary) == 4 and summary["mean_delta_ppl"].notna().all()
    fig = plot_retention(first.to_frame(), tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == 2  # one panel per corpus


def test_plot_retention_draws_the_frame(tmp_path, monkeypatch):
    """Each panel's lines carry the frame's numbers: x = retention in %, y = PPL (corpus) or accuracy (task)."""
    import matplotlib.figure

    drawn: list[matplotlib.figure.Figure] = []
    save = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        drawn.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    rows = []
    for o, order in enumerate(("magnitude", "random")):
        for retention in (0.5, 1.0, 0.2):  # unsorted on purpose
            kept = round(10 * retention)
            base = {"order": order, "retention": retention, "n_heads_kept": kept}
            rows.append(
                {**base, "corpus": "wiki", "ppl": 20.0 + 100 * (1 - retention) * (o + 1), "accuracy": np.nan}
            )
            rows.append(
                {**base, "corpus": "boolq", "ppl": np.nan, "accuracy": 0.8 - 0.3 * (1 - retention) * (o + 1)}
            )
    frame = pd.DataFrame(rows)
    returned = plot_retention(frame, tmp_path / "r.png", title="t")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(drawn) == 1 and drawn[0] is returned  # the figure it saved is the one it returns
    axes = drawn[0].axes
    assert [ax.get_title() for ax in axes] == ["wiki", "boolq"]
    assert axes[0].get_yscale() == "log" and axes[1].get_yscale() == "linear"
    for ax, corpus, column in zip(axes, ("wiki", "boolq"), ("ppl", "accuracy"), strict=True):
        assert ax.xaxis_inverted()
        assert [ln.get_label() for ln in ax.get_lines()] == ["magnitude", "random"]
        for line, order in zip(ax.get_lines(), ("magnitude", "random"), strict=True):
            want = frame[(frame["corpus"] == corpus) & (frame["order"] == order)].sort_values("retention")
            np.testing.assert_allclose(line.get_xdata(), want["retention"].to_numpy() * 100)
            np.testing.assert_allclose(line.get_ydata(), want[column].to_numpy())


# --------------------------------------------------------------------------- head statistics: one pass, taxonomy included


@pytest.mark.parametrize("n_kv", [None, 2])
def test_head_stats_taxonomy_equals_classify_heads(n_kv):
    """The labels head_stats collects in its own passes are classify_heads' table, and the orders use them."""
    model = make_tiny(n_kv=n_kv, seed=4)
    toks = random_tokens(3, 9, seed=6)
    stats = head_stats(model, toks, batch_size=2)
    assert stats.taxonomy is not None
    want = classify_heads(model, toks).to_frame()
    pd.testing.assert_frame_equal(stats.taxonomy.to_frame(), want)
    assert want["f_cur"].nunique() > 1 and want["f_sink"].nunique() > 1  # a table with varied entries
    two = head_stats(model, toks, sink_positions=(0, 1))
    pd.testing.assert_frame_equal(
        two.taxonomy.to_frame(), classify_heads(model, toks, sink_positions=(0, 1)).to_frame()
    )
    plain = head_stats(model, toks, taxonomy=False)
    assert plain.taxonomy is None
    for name in ("z_mean", "out_norm", "entropy"):  # the taxonomy readers change none of the statistics
        torch.testing.assert_close(getattr(plain, name), getattr(stats, name), atol=1e-6, rtol=1e-6)
    orders = heads.head_orders(model, stats)
    assert orders["taxonomy"] == taxonomy_order(want, stats.out_norm)
    assert "taxonomy" not in heads.head_orders(model, plain)
    counts = stats.summary()["taxonomy_counts"]
    assert counts == {str(k): int(v) for k, v in want["label"].value_counts().items()}
    assert sum(counts.values()) == 8
    with pytest.raises(ValueError, match="query after the sink"):
        head_stats(model, random_tokens(2, 1), taxonomy=True)
    assert head_stats(model, random_tokens(2, 1), taxonomy=False).n_positions == 2


def test_head_stats_from_cache_and_extra_hooks():
    model = make_tiny(n_kv=2, seed=8)
    toks = random_tokens(2, 7, seed=2)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    a, b = head_stats(model, toks), heads.head_stats_from_cache(model, cache)
    for name in ("z_mean", "out_norm", "entropy"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-6, rtol=1e-6)
    assert a.n_positions == b.n_positions == 14
    pd.testing.assert_frame_equal(a.taxonomy.to_frame(), b.taxonomy.to_frame())
    # extra hooks run before the readers: a removed head has zero mean z and zero output norm, marked modified
    removed = head_stats(model, toks, extra_hooks=head_ablation_hooks(model, [(0, 1)]))
    assert (removed.z_mean[0, 1] == 0).all() and removed.out_norm[0, 1] == 0
    assert removed.out_norm[0, 0] == pytest.approx(a.out_norm[0, 0].item(), rel=1e-6)
    assert removed.taxonomy.modified_heads == [(0, 1)]
    assert not has_hooks(model)


def test_head_table_columns_and_values():
    model = make_tiny(seed=3)
    toks = random_tokens(2, 6, seed=1)
    stats = head_stats(model, toks)
    sweep = single_head_sweep(model, toks)
    table = heads.head_table(model, stats, sweep)
    assert list(table.columns) == [
        "layer",
        "head",
        "out_norm",
        "entropy",
        "weight_magnitude",
        "delta_ppl",
        "label",
    ]
    labels = stats.taxonomy.to_frame().set_index(["layer", "head"])["label"]
    mags = weight_magnitude(model)
    for r in table.itertuples():
        assert r.weight_magnitude == pytest.approx(mags[r.layer, r.head].item())
        assert r.delta_ppl == pytest.approx(sweep.delta_ppl[r.layer, r.head].item())
        assert r.out_norm == pytest.approx(stats.out_norm[r.layer, r.head].item())
        assert r.label == labels[(r.layer, r.head)]
    bare = heads.head_table(model, head_stats(model, toks, taxonomy=False))
    assert list(bare.columns) == ["layer", "head", "out_norm", "entropy", "weight_magnitude"]


def test_moved_names_are_exported_by_their_package():
    """Each name lives in one module and is exported by its package (``mechgeom.analyses.heads``), by the top
    level where it is an entry point, and nowhere else: the pruning module re-exports nothing."""
    import mechgeom
    import mechgeom.analyses.heads.orders as head_orders
    import mechgeom.analyses.scoring as evaluation
    import mechgeom.hooks as hooks

    stats_mod = importlib.import_module("mechgeom.analyses.heads.stats")
    assert mechgeom.score_choices is score_choices is evaluation.score_choices
    assert mechgeom.task_accuracy is task_accuracy is evaluation.task_accuracy
    assert heads.head_stats is head_stats is stats_mod.head_stats is mechgeom.head_stats
    assert heads.mad_outliers is mad_outliers is head_orders.mad_outliers
    assert heads.retention_levels is retention_levels is head_orders.retention_levels
    assert hooks.HeadAblationMode is not None
    assert {"HeadStats", "head_orders", "taxonomy_order", "weight_magnitude", "RETENTION_LEVELS"} <= set(
        heads.__all__
    )
    assert not {"head_stats", "score_choices", "head_orders"} & set(pruning.__all__)


# --------------------------------------------------------------------------- summaries


def test_single_head_summary_against_statistics_module():
    clean = torch.tensor([1.0, 1.2])
    nll = torch.tensor([[[1.01, 1.21], [1.02, 1.22]], [[3.0, 3.5], [1.0, 1.21]], [[1.03, 1.19], [1.02, 1.2]]])
    res = SingleHeadResult(clean_nll=clean, nll=nll)
    s = res.summary(k=5)
    clean_ppl = math.exp(1.1)
    deltas = {
        (la, h): math.exp(float(nll[la, h].double().mean())) - clean_ppl for la in range(3) for h in range(2)
    }
    med = statistics.median(deltas.values())
    mad = 1.4826 * statistics.median(abs(v - med) for v in deltas.values())
    assert s["clean_ppl"] == pytest.approx(clean_ppl, rel=1e-6)
    assert s["median_delta_ppl"] == pytest.approx(med, rel=1e-4, abs=1e-6)
    assert s["mad_scaled"] == pytest.approx(mad, rel=1e-3, abs=1e-6)
    assert s["threshold"] == pytest.approx(med + 5 * mad, rel=1e-3, abs=1e-6)
    ranked = sorted(deltas, key=lambda lh: (-deltas[lh], lh))
    assert [s["top"]["layer"], s["top"]["head"]] == list(ranked[0]) == [1, 0]
    assert s["top"]["delta_ppl"] == pytest.approx(deltas[(1, 0)], rel=1e-5)
    assert s["worst_head"] == [1, 0] and s["worst_delta_ppl"] == s["top"]["delta_ppl"]
    assert s["top"]["ratio_to_median"] == pytest.approx(deltas[(1, 0)] / med, rel=1e-3)
    assert [(r["layer"], r["head"]) for r in s["top5"]] == ranked[:5]
    assert s["critical"] == [[la, h] for la, h in ranked if deltas[(la, h)] > med + 5 * mad] == [[1, 0]]
    assert s["n_critical"] == 1 and s["k"] == 5.0 and s["n_heads"] == 6 and s["mode"] == "zero"
    assert json.loads(json.dumps(s)) == s  # plain JSON types
    assert res.summary(k=1e6)["critical"] == []


def test_retention_summary_comparison_and_taxonomy_wins(monkeypatch):
    import mechgeom.analyses.scoring as evaluation

    model = make_tiny(n_layers=2, seed=5)
    monkeypatch.setattr(evaluation, "_encode", lambda _m, text, *, prepend_bos: [ord(c) % 50 for c in text])
    items = [
        TaskItem("t", "abc def", (" x", " yz"), 0),
        TaskItem("t", "ghij", (" q", " rs"), 1),
        TaskItem("t", "klm no p", (" u", " v"), 1),
    ]
    corpora = {"a": random_tokens(2, 10, seed=1), "b": random_tokens(2, 8, seed=2)}
    stats = head_stats(model, corpora["a"])
    orders = heads.head_orders(model, stats, seed=1)
    curves = retention_curves(model, orders, corpora, levels=(1.0, 0.75, 0.5, 0.25), task=("t", items))
    frame = curves.to_frame()
    s = curves.summary()
    assert s["orders"] == list(orders) == ["taxonomy", "magnitude", "entropy", "random"]
    assert s["levels"] == [1.0, 0.75, 0.5, 0.25] and s["n_heads"] == 8 and s["mode"] == "zero"
    for order in orders:
        vals = [
            r.delta_ppl
            for r in frame.itertuples()
            if r.order == order and r.retention < 1 and r.corpus != "t"
        ]
        assert len(vals) == 6
        assert s["mean_delta_ppl"][order] == pytest.approx(sum(vals) / len(vals))
        for corpus in ("a", "b", "t"):
            col = "accuracy" if corpus == "t" else "delta_ppl"
            sub = [
                getattr(r, col)
                for r in frame.itertuples()
                if (r.order, r.corpus) == (order, corpus) and r.retention < 1
            ]
            assert s["by_corpus"][corpus][order] == pytest.approx(sum(sub) / len(sub))
    comp = curves.comparison()
    assert len(comp) == 3 * 3
    for r in comp.to_dict("records"):
        metric = "accuracy" if r["corpus"] == "t" else "ppl"
        assert r["metric"] == metric
        got = {
            o: float(
                frame[
                    (frame.order == o) & (frame.corpus == r["corpus"]) & (frame.retention == r["retention"])
                ][metric].iloc[0]
            )
            for o in orders
        }
        assert {o: r[o] for o in orders} == pytest.approx(got)
        best = None
        for o in orders:  # the first order wins ties
            if best is None or (got[o] > got[best] if metric == "accuracy" else got[o] < got[best]):
                best = o
        assert r["best"] == best
    wins = s["taxonomy_wins"]
    assert set(wins) == {"a", "b", "t"} and set(wins["a"]) == {"magnitude", "entropy", "random"}
    for corpus, per in wins.items():
        sub = comp[comp.corpus == corpus]
        for base, w in per.items():
            if corpus == "t":
                want = [
                    float(r) for r, x, y in zip(sub.retention, sub.taxonomy, sub[base], strict=True) if x > y
                ]
            else:
                want = [
                    float(r) for r, x, y in zip(sub.retention, sub.taxonomy, sub[base], strict=True) if x < y
                ]
            assert w == {"taxonomy_better_at": want, "n_levels": 3}
    assert json.loads(json.dumps(s)) == s
    no_tax = pruning.RetentionCurves(frame=frame[frame.order != "taxonomy"], n_heads=8)
    assert no_tax.summary()["taxonomy_wins"] == {}
    assert pruning.RetentionCurves(frame=pd.DataFrame(), n_heads=8).summary()["orders"] == []


def test_sweep_exactness_measures_the_gap():
    model = make_tiny(n_layers=3, n_kv=2, seed=2)
    toks = random_tokens(2, 8, seed=4)
    sweep = single_head_sweep(model, toks)
    check = pruning.sweep_exactness(model, toks, sweep)
    assert check["heads"] == [[0, 0], [1, 1], [2, 3]]
    assert check["max_abs_nll_gap"] < 1e-5
    assert pruning.sweep_exactness(model, toks, sweep, 0) == {"heads": [], "max_abs_nll_gap": None}
    tampered = SingleHeadResult(clean_nll=sweep.clean_nll, nll=sweep.nll.clone())
    tampered.nll[1, 2, 1] += 0.5
    gap = pruning.sweep_exactness(model, toks, tampered, [(1, 2), (0, 0)])["max_abs_nll_gap"]
    assert gap == pytest.approx(0.5, abs=1e-5)
