"""The memory budget of an analysis' outputs (issue 35, point 3): estimated before anything runs, refused above the
budget with the estimate and the ways out (:mod:`mechgeom.analyses.budget`)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny, random_tokens

from mechgeom.analyses import budget
from mechgeom.analyses.budget import (
    MemoryBudgetError,
    contribution_budget,
    contribution_output_bytes,
    free_memory,
)
from mechgeom.analyses.contribution.weights import (
    INTER_METRICS,
    INTRA_METRICS,
    ContributionCollector,
    contribution_weights,
)


def test_smollm2_at_2048_tokens_with_every_layer_and_the_default_metrics_needs_33_7_gb() -> None:
    """The issue's example, by arithmetic: 30 layers, 9 heads, 2,048 x 2,048, 7 intra- and 4 inter-head float32."""
    n = contribution_output_bytes(
        batch=1,
        layers=30,
        heads=9,
        queries=2048,
        keys=2048,
        intra=len(INTRA_METRICS),
        inter=len(INTER_METRICS),
    )
    metrics = 30 * 2048 * 2048 * 4 * (9 * 7 + 4)  # 33,722,204,160 bytes
    assert n == metrics + 30 * 9 * 2048 * (1 + 4)  # and the modified mask and shares
    assert budget.format_bytes(n) == "33.7 GB"
    # one kept query per text is O(k): 2,048 times less for the metrics
    last = contribution_output_bytes(batch=1, layers=30, heads=9, queries=1, keys=2048, intra=7, inter=4)
    assert last == metrics // 2048 + 30 * 9 * (1 + 4)


def test_the_estimate_is_what_contribution_weights_allocates() -> None:
    model = make_tiny(n_heads=4, n_kv=2, seed=1)
    tokens = random_tokens(batch=3, pos=10, seed=2)
    res = contribution_weights(model, tokens, intra=["contribution", "attention"], inter=["contribution"])
    kept = [*res.intra.values(), *res.inter.values(), res.modified, res.modified_share]
    allocated = sum(t.numel() * t.element_size() for t in kept)
    estimate = contribution_output_bytes(batch=3, layers=2, heads=4, queries=10, keys=10, intra=2, inter=1)
    assert estimate == allocated


def test_a_tiny_budget_raises_before_the_forward_pass_with_the_estimate_and_the_ways_out() -> None:
    model = make_tiny(n_heads=4, seed=1)
    tokens = random_tokens(batch=2, pos=12, seed=2)
    ran: list[str] = []

    def spy(x, hook):
        ran.append(hook.name)
        return x

    hooks = [("hook_embed", spy)]
    estimate = contribution_output_bytes(
        batch=2, layers=2, heads=4, queries=12, keys=12, intra=len(INTRA_METRICS), inter=len(INTER_METRICS)
    )
    with pytest.raises(MemoryBudgetError) as err:
        contribution_weights(model, tokens, extra_hooks=hooks, memory_budget=estimate - 1)
    assert ran == [], "the budget is checked before the forward pass"
    msg = str(err.value)
    assert f"({estimate} bytes)" in msg and "2 text(s) x 12 positions, 2 layer(s)" in msg
    assert f"memory budget of {budget.format_bytes(estimate - 1)} (memory_budget=)" in msg
    for way in (
        "queries=[-1]",
        "intra=['contribution']",
        "layers=[...]",
        "on_layer=",
        "memory_budget=<bytes>",
    ):
        assert way in msg, way
    assert isinstance(err.value, MemoryError)

    res = contribution_weights(model, tokens, extra_hooks=hooks, memory_budget=estimate)  # exactly enough
    assert ran and res.intra["contribution"].shape == (2, 2, 4, 12, 12)
    contribution_weights(model, tokens, memory_budget=math.inf)
    with pytest.raises(ValueError, match="positive number of bytes"):
        contribution_weights(model, tokens, memory_budget=0)


def test_the_default_budget_is_half_the_free_memory_or_the_module_default(monkeypatch) -> None:
    model = make_tiny(n_heads=4, seed=1)
    tokens = random_tokens(batch=1, pos=8, seed=2)
    estimate = contribution_output_bytes(batch=1, layers=2, heads=4, queries=8, keys=8, intra=7, inter=4)
    assert free_memory("cpu") > 0
    monkeypatch.setattr(budget, "free_memory", lambda device: 2 * estimate)
    contribution_weights(model, tokens)  # 50 % of the free memory: just enough
    monkeypatch.setattr(budget, "free_memory", lambda device: 2 * estimate - 2)
    with pytest.raises(MemoryBudgetError, match=r"50% of the .* free on cpu"):
        contribution_weights(model, tokens)
    monkeypatch.setattr(budget, "MEMORY_BUDGET", math.inf)  # the module default wins over the free memory
    contribution_weights(model, tokens)
    monkeypatch.setattr(budget, "MEMORY_BUDGET", 100)
    with pytest.raises(MemoryBudgetError, match=r"mechgeom\.analyses\.budget\.MEMORY_BUDGET\)"):
        contribution_weights(model, tokens, memory_budget=None)
    contribution_weights(model, tokens, memory_budget=estimate)  # the argument wins over both


def test_a_cache_is_checked_and_a_streaming_collector_needs_one_layer() -> None:
    model = make_tiny(n_heads=4, n_layers=3, seed=1)
    tokens = random_tokens(batch=2, pos=9, seed=2)
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(MemoryBudgetError, match=r"2 text\(s\) x 9 positions, 3 layer\(s\)"):
        contribution_weights(model, tokens, cache=cache, memory_budget=1000)
    one_layer = contribution_output_bytes(batch=2, layers=1, heads=4, queries=9, keys=9, intra=1, inter=0)
    col = ContributionCollector(model, intra=["contribution"], inter=[], on_layer=lambda layer, p: None)
    contribution_budget(col, (2, 9), memory_budget=one_layer)  # one layer's worth, not three
    with pytest.raises(MemoryBudgetError, match=r"1 layer\(s\) \(one at a time, streamed\)"):
        contribution_budget(col, (2, 9), memory_budget=one_layer - 1)
    # half-precision models give float32 outputs, out_dtype its own itemsize
    half = ContributionCollector(model.to(torch.bfloat16), intra=["contribution"], inter=[])
    three = contribution_output_bytes(batch=2, layers=3, heads=4, queries=9, keys=9, intra=1, inter=0)
    contribution_budget(half, (2, 9), memory_budget=three)
    with pytest.raises(MemoryBudgetError):
        contribution_budget(half, (2, 9), memory_budget=three - 1)
    small = ContributionCollector(model, intra=["contribution"], inter=[], out_dtype=torch.bfloat16)
    contribution_budget(small, (2, 9), memory_budget=contribution_output_bytes(
        batch=2, layers=3, heads=4, queries=9, keys=9, intra=1, inter=0, itemsize=2
    ))  # fmt: skip


def test_queries_are_the_way_out_the_message_names() -> None:
    """A budget the whole result exceeds but the last query's rows fit: ``queries=[-1]`` runs under it."""
    model = make_tiny()
    tokens = random_tokens(batch=2, pos=24)
    full = contribution_output_bytes(batch=2, layers=2, heads=4, queries=24, keys=24, intra=7, inter=4)
    last = contribution_output_bytes(batch=2, layers=2, heads=4, queries=1, keys=24, intra=7, inter=4)
    limit = (full + last) / 2
    with pytest.raises(MemoryBudgetError, match="queries="):
        contribution_weights(model, tokens, memory_budget=limit)
    res = contribution_weights(model, tokens, queries=[-1], memory_budget=limit)
    assert res.intra["contribution"].shape == (2, 2, 4, 1, 24)
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(MemoryBudgetError):
        contribution_weights(model, tokens, cache=cache, memory_budget=limit)
    contribution_weights(model, tokens, cache=cache, queries=[-1], memory_budget=limit)
