"""The registry of source ranking methods (mechgeom.analyses.faithfulness.rankings): a method registered under
a name serves every sweep of the masking harness, checked against brute-force masks built with loops."""

from __future__ import annotations

import math
from fractions import Fraction
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens

from mechgeom.analyses import faithfulness, scoring
from mechgeom.analyses.faithfulness import rankings
from mechgeom.analyses.scoring import text_nll
from mechgeom.data import TaskItem
from mechgeom.hooks import MODES, has_hooks, hook_name


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch):
    """Each test registers into a copy of the registry, so nothing leaks into other tests."""
    monkeypatch.setattr(rankings, "_METHODS", dict(rankings._METHODS))


def pattern_copy(request, names):
    """The attention pattern itself, per head: the ranking of the built-in ``attention`` metric."""

    def read(pattern, hook, layer):
        for name in names:
            request.emit(name, layer, pattern.detach().clone())

    return [(hook_name(la, "pattern"), partial(read, layer=la)) for la in request.layers]


def earliest_first(request, names):
    """Score ``-j`` for source ``j``: the earliest sources rank first; no pass needed (one ranking per layer)."""
    b, pos = request.tokens.shape
    scores = -torch.arange(pos, dtype=torch.float32).expand(b, 1, pos, pos)
    for layer in request.layers:
        for name in names:
            request.emit(name, layer, scores.clone())
    return []


def _frames_alike(frame: pd.DataFrame, a: str, b: str) -> None:
    """The rows of metric ``a`` equal those of metric ``b`` (every column but the metric's name)."""
    rows = [frame[frame["metric"] == m].drop(columns="metric").reset_index(drop=True) for m in (a, b)]
    assert len(rows[0]) > 0
    pd.testing.assert_frame_equal(*rows)


def test_a_registered_method_serves_every_sweep(monkeypatch) -> None:
    rankings.register_ranking("pattern_copy", pattern_copy, scopes=("intra",))
    assert "pattern_copy" in rankings.ranking_methods("intra")
    assert "pattern_copy" not in rankings.ranking_methods("inter")
    model, tokens = make_tiny(seed=11), random_tokens(3, 9, seed=12)
    kw = dict(metrics=["attention", "pattern_copy"], rates=(0.0, 0.4, 0.8), batch_size=2, n_boot=50)
    ppl = faithfulness.perplexity_curves(model, tokens, **kw)
    _frames_alike(ppl, "attention", "pattern_copy")
    assert (ppl.loc[ppl["rate"] > 0, "delta_ppl"].abs() > 0).all()
    vocab = model.cfg.d_vocab
    monkeypatch.setattr(scoring, "_encode", lambda _m, text, *, prepend_bos: [ord(c) % vocab for c in text])
    items = [
        TaskItem("winogrande", "a b c", (" d e", " f"), 0),
        TaskItem("boolq", "g h i j", (" k", " l m"), 1),
    ]
    acc = faithfulness.task_accuracy_curves(model, items, **kw)
    _frames_alike(acc, "attention", "pattern_copy")
    encoder = make_tiny(attention_dir="bidirectional", seed=13)
    emb = faithfulness.embedding_curves(encoder, tokens, **{**kw, "n_boot": 50})
    np.testing.assert_array_equal(emb.effects[0], emb.effects[1])
    assert (emb.effects[:, :, 1:] > 0).all()
    ranked = faithfulness.source_rankings(model, tokens, metrics=["attention", "pattern_copy"])
    assert ranked["attention"].same_as(ranked["pattern_copy"])
    assert not has_hooks(model) and not has_hooks(encoder)


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_a_registered_method_matches_brute_force_masks(scope: str) -> None:
    """``earliest_first`` removes, at rate r, the first ``ceil(r (i+1))`` sources of query ``i``
    (comprehensiveness) or the last ones (sufficiency); the ΔPPL equals that of masks set by hand."""
    rankings.register_ranking("earliest", earliest_first)
    model, tokens = make_tiny(seed=14), random_tokens(4, 10, seed=15)
    rate, layers = 0.3, [0, 1]
    frame = faithfulness.perplexity_curves(
        model, tokens, metrics=["earliest"], rates=(0.0, rate), layers=layers, scope=scope, batch_size=3
    )
    n, pos = tokens.shape
    for mode in MODES:
        mask = torch.zeros(n, 4, pos, pos, dtype=torch.bool)
        for i in range(pos):
            k = math.ceil(Fraction(str(rate)) * (i + 1))
            removed = range(k) if mode == "comprehensiveness" else range(i + 1 - k, i + 1)
            for j in removed:
                mask[:, :, i, j] = True

        def zero(pattern, hook, mask=mask):
            return pattern.masked_fill(mask, 0.0)

        nll = text_nll(model, tokens, [(hook_name(la, "pattern"), zero) for la in layers])
        row = frame[(frame["mode"] == mode) & (frame["rate"] == rate)].iloc[0]
        assert row["ppl"] == pytest.approx(float(torch.exp(nll.mean())), rel=1e-5)
    assert not has_hooks(model)


def test_the_registry_refuses_what_it_cannot_serve() -> None:
    model, tokens = make_tiny(seed=16), random_tokens(2, 6, seed=17)
    with pytest.raises(ValueError, match="'attention' is registered already; pass replace=True"):
        rankings.register_ranking("attention", earliest_first)
    with pytest.raises(ValueError, match="other than 'clean'"):
        rankings.register_ranking("clean", earliest_first)
    with pytest.raises(ValueError, match=r"subset of \['intra', 'inter'\]"):
        rankings.register_ranking("x", earliest_first, scopes=("global",))
    with pytest.raises(TypeError, match="must be callable"):
        rankings.register_ranking("x", "not a function")
    with pytest.raises(ValueError, match=r"unknown intra-head ranking metric\(s\) \['sparkle'\].*'random'"):
        faithfulness.perplexity_curves(model, tokens, metrics=["sparkle"])
    with pytest.raises(ValueError, match=r"unknown ranking method 'sparkle'; registered: \['attention'"):
        rankings.ranking_method("sparkle")
    rankings.register_ranking("inter_only", earliest_first, scopes=("inter",))
    with pytest.raises(ValueError, match=r"unknown intra-head ranking metric\(s\) \['inter_only'\]"):
        faithfulness.perplexity_curves(model, tokens, metrics=["inter_only"])

    @rankings.register_ranking("flat")
    def flat(request, names):
        request.emit("flat", request.layers[0], torch.zeros(2, 1, 6))  # [batch, 1, pos]: no key axis
        return []

    with pytest.raises(ValueError, match=r"emitted scores of shape \(2, 1, 6\) at layer 0; need \[batch=2"):
        faithfulness.perplexity_curves(model, tokens, metrics=["flat"], rates=(0.5,))

    @rankings.register_ranking("lazy")
    def lazy(request, names):
        return []  # emits nothing

    with pytest.raises(RuntimeError, match=r"ranking method 'lazy' gave no scores for layer\(s\) \[0, 1\]"):
        faithfulness.source_rankings(model, tokens, metrics=["lazy"])
    assert rankings.ranking_methods()[-2:] == ("flat", "lazy")
    assert not has_hooks(model)
