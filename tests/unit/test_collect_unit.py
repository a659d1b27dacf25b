"""``mechgeom.collect``: several collectors fed by ONE forward pass per batch.

The reference for every collector is the collector alone, fed by its own ``model.run_with_hooks`` passes
over the same batches (each collector is itself checked against brute force in its own test module), so a
shared pass must give the same tables, bit for bit up to float rounding. GQA models check that the shared
reader expands ``hook_v`` once for everyone.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens

import mechgeom
from mechgeom import (
    ContributionCollector,
    HeadStatsCollector,
    SelectionCollector,
    SinkCollector,
    TaxonomyCollector,
    collect,
)
from mechgeom.hooks import has_hooks, readers

BATCH = 2


def _alone(model, tokens, collector, extra=()):
    """The reference: the collector's own hooks, one ``run_with_hooks`` per batch."""
    with torch.no_grad():
        for s in range(0, tokens.shape[0], BATCH):
            model.run_with_hooks(tokens[s : s + BATCH], fwd_hooks=[*extra, *collector.fwd_hooks])
    return collector.result(tokens)


def _makers(model):
    return [
        lambda: SinkCollector(model),
        lambda: TaxonomyCollector(model),
        lambda: SelectionCollector(model, ns=(1, 2), n_random=2, bound=False),  # several batches: no bound
        lambda: HeadStatsCollector(model, taxonomy=True),
        lambda: ContributionCollector(model),
    ]


def _same(a, b):
    fa, fb = a.to_frame(), b.to_frame()
    assert len(fa) > 0
    pd.testing.assert_frame_equal(fa, fb, check_exact=False, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_kv", [None, 2])
def test_one_pass_for_several_collectors_equals_each_alone(n_kv):
    model = make_tiny(n_layers=3, n_kv=n_kv, seed=5)
    toks = random_tokens(5, 10, seed=2)
    makers = _makers(model)
    together = collect(model, toks, [m() for m in makers], batch_size=BATCH)
    assert len(together) == len(makers)
    for got, make in zip(together, makers, strict=True):
        _same(got, _alone(model, toks, make()))
    assert not has_hooks(model)
    single = collect(model, toks, SinkCollector(model), batch_size=BATCH)  # one collector: one result
    _same(single, _alone(model, toks, SinkCollector(model)))


def test_shared_reader_reads_each_layer_once(monkeypatch):
    model = make_tiny(n_layers=3, n_kv=2, seed=1)
    toks = random_tokens(4, 8, seed=3)
    calls = []
    real = readers.modified_mask
    monkeypatch.setattr(readers, "modified_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    forwards = []
    real_run = readers.run_hooks
    monkeypatch.setattr(readers, "run_hooks", lambda *a, **k: forwards.append(1) or real_run(*a, **k))
    # a read-only hook on every hook_z: another hook is there, so the reader checks z (hooks/readers._sole_hook)
    watch = [(f"blocks.{layer}.attn.hook_z", lambda z, hook: None) for layer in range(3)]
    collect(
        model,
        toks,
        [SinkCollector(model), TaxonomyCollector(model), SelectionCollector(model, ns=(1, 2), bound=False)],
        batch_size=2,
        extra_hooks=watch,
    )
    assert len(forwards) == 2  # one forward per batch of 2 texts, not one per collector
    assert len(calls) == 2 * 3  # one modified-z check per layer per batch, shared by the three collectors
    calls.clear()
    collect(model, toks, [SinkCollector(model), TaxonomyCollector(model)], batch_size=2)
    assert calls == []  # only the shared readers' hooks: nothing can have changed z, no check


def test_the_pass_stops_after_the_last_layer_read():
    model = make_tiny(n_layers=3, seed=2)
    toks = random_tokens(2, 8, seed=0)
    seen = []
    probe = ("blocks.2.attn.hook_pattern", lambda x, hook: seen.append(x.shape[0]))  # layer 2 runs
    collect(
        model,
        toks,
        [SinkCollector(model, layers=[0]), TaxonomyCollector(model, layers=1)],
        extra_hooks=[probe],
    )
    assert seen == []  # layer 2 is never run
    collect(model, toks, [SinkCollector(model, layers=[0]), HeadStatsCollector(model)], extra_hooks=[probe])
    assert seen == [2]  # HeadStatsCollector reads every layer


def test_interventions_are_applied_and_marked():
    model = make_tiny(n_layers=2, n_kv=2, seed=4)
    toks = random_tokens(4, 9, seed=6)
    extra = mechgeom.head_ablation_hooks(model, [(1, 2)])
    got = collect(
        model, toks, [SinkCollector(model), ContributionCollector(model)], batch_size=BATCH, extra_hooks=extra
    )
    want = [_alone(model, toks, c, extra) for c in (SinkCollector(model), ContributionCollector(model))]
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    modified = got[1].modified  # [batch, layer, head, query]: the collector says which head was changed
    assert modified[:, 1, 2].all() and not modified[:, 0].any() and not modified[:, 1, [0, 1, 3]].any()


def test_bad_arguments_raise_clear_errors():
    model = make_tiny(seed=0)
    toks = random_tokens(2, 6, seed=0)
    sinks = SinkCollector(model)
    with pytest.raises(ValueError, match="no collectors"):
        collect(model, toks, [])
    with pytest.raises(ValueError, match="twice"):
        collect(model, toks, [sinks, sinks])
    with pytest.raises(TypeError, match=r"collectors\[1\].*not a collector"):
        collect(model, toks, [sinks, object()])
    with pytest.raises(TypeError, match="collector or a sequence"):
        collect(model, toks, "sinks")
    with pytest.raises(TypeError, match="float"):
        collect(model, toks.float(), sinks)  # the one token validator, also for 2-D tensors
    with pytest.raises(ValueError, match="out of range"):
        collect(model, toks + 1000, sinks)
    with pytest.raises(ValueError, match="batch_size"):
        collect(model, toks, sinks, batch_size=0)
    assert not has_hooks(model)


def test_a_collector_that_raises_leaves_no_hooks():
    model = make_tiny(n_layers=2, seed=3)
    toks = random_tokens(2, 6, seed=1)

    def boom(_layer, _metrics):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        collect(model, toks, [SinkCollector(model), ContributionCollector(model, on_layer=boom)])
    assert not has_hooks(model)
    _same(collect(model, toks, SinkCollector(model)), _alone(model, toks, SinkCollector(model)))


def test_selection_over_batches_is_the_selection_of_one_pass():
    """0.2 kept only the last batch's geometry (1 text of 5, with the 5 texts' tokens); every text now counts,
    the random baseline included (one generator per layer across passes)."""
    model = make_tiny(n_layers=2, n_kv=2, seed=5)
    toks = random_tokens(5, 10, seed=2)
    make = lambda: SelectionCollector(model, ns=(1, 2), n_random=2, bound=False)  # noqa: E731
    batched = collect(model, toks, make(), batch_size=BATCH)
    whole = collect(model, toks, make(), batch_size=len(toks))
    assert batched.per_query["f_top"].shape[0] == len(toks) == batched.modified.shape[0]
    for name, t in whole.per_query.items():
        torch.testing.assert_close(batched.per_query[name], t, equal_nan=True, msg=name)
    _same(batched, whole)


def test_the_bound_refuses_a_second_pass_and_fits_one_pass():
    model = make_tiny(n_layers=2, seed=5)
    toks = random_tokens(3, 8, seed=2)
    with pytest.raises(ValueError, match=r"one pass.*batch_size=len"):
        collect(model, toks, SelectionCollector(model, ns=(1, 2)), batch_size=2)
    assert not has_hooks(model)
    one = collect(model, toks, SelectionCollector(model, ns=(1, 2)), batch_size=3)
    assert one.per_query["bound"].shape[0] == 3 and one.params
