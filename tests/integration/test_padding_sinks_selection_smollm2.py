"""Padding and ``queries=`` in sinks, token selection and the taxonomy on SmolLM2-135M (issue 35).

A list of texts of different lengths is padded on the tokenizer's ``padding_side`` (left and right here); every
per-text number must equal the same text run alone, counts must be those of the real queries, and a sink at
"position 0" must be each text's first real token. The issue's numbers: ``token_selection`` counted 28 queries
for a 4-token text beside a 14-token one, ``classify_heads`` 26 queries where 17 are real.
"""

from __future__ import annotations

import pytest
import torch

from mechgeom.analyses.heads import classify_heads
from mechgeom.analyses.selection import token_selection
from mechgeom.analyses.sinks import convexity_check, sink_statistics

pytestmark = pytest.mark.integration

SHORT = "A short one."  # 4 tokens
SHORT5 = "The cat sat down."  # 5 tokens
LONG = "The capital of France is Paris, a city on the river Seine"  # 14 tokens
LAYERS = [0, 3]


@pytest.fixture(params=["left", "right"])
def side(request: pytest.FixtureRequest, smollm2):
    """The tokenizer's padding side for one test, restored after it."""
    before = smollm2.tokenizer.padding_side
    smollm2.tokenizer.padding_side = request.param
    yield request.param
    smollm2.tokenizer.padding_side = before


def _n(model, text: str) -> int:
    return int(model.to_tokens(text).shape[1])


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, equal_nan=True)


def test_token_selection_counts_the_real_queries_of_a_4_token_text(smollm2, side):
    assert (_n(smollm2, SHORT), _n(smollm2, LONG)) == (4, 14)
    kw = dict(layers=LAYERS, ns=[1, 2, 4], n_random=0, dtype=torch.float64)
    res = token_selection(smollm2, [SHORT, LONG], **kw)
    s = res.summary()
    assert s["queries_per_text"] == [4, 14]  # was 14 per text: 28 queries for the pair, 14 for the 4 tokens
    assert s["n_queries"] == 18
    for b, text in enumerate([SHORT, LONG]):
        alone = token_selection(smollm2, text, **kw)
        n = _n(smollm2, text)
        for name in ("f_top", "f_nosink", "certificate", "sink_in_top"):
            _close(res.per_query[name][b, ..., :n, :], alone.per_query[name][0])
            assert bool(res.per_query[name][b, ..., n:, :].isnan().all())
    last = token_selection(smollm2, [SHORT, LONG], queries=[-1], **kw)
    assert last.summary()["n_queries"] == 2
    for b, text in enumerate([SHORT, LONG]):
        n = _n(smollm2, text)
        alone = token_selection(smollm2, text, **kw)
        _close(last.per_query["f_top"][b, ..., n - 1, :], alone.per_query["f_top"][0, ..., n - 1, :])


def test_classify_heads_counts_17_real_queries_not_26(smollm2, side):
    assert (_n(smollm2, SHORT5), _n(smollm2, LONG)) == (5, 14)
    res = classify_heads(smollm2, [SHORT5, LONG], layers=LAYERS)
    assert int(res.sums["n_queries"][0, 0]) == 17  # 4 + 13 real queries after the sink (26 with padding)
    alone = [classify_heads(smollm2, t, layers=LAYERS) for t in (SHORT5, LONG)]
    for key in ("n_queries", "n_cur", "n_sink", "sink_mass", "cos_sink_sum", "cos_cur_sum"):
        _close(res.sums[key], alone[0].sums[key] + alone[1].sums[key])
    pooled = res.to_frame()
    assert (pooled["n_queries"] == 17).all()
    last = classify_heads(smollm2, [SHORT5, LONG], layers=LAYERS, queries=[-1])
    assert int(last.sums["n_queries"][0, 0]) == 2


def test_sink_statistics_of_padded_texts_are_the_texts_alone(smollm2, side):
    res = sink_statistics(smollm2, [SHORT, LONG], layers=LAYERS)
    for b, text in enumerate([SHORT, LONG]):
        n = _n(smollm2, text)
        alone = sink_statistics(smollm2, text, layers=LAYERS)
        for name in ("sink_rate", "norm_ratio_vt", "cos_sink_tokens", "cos_sink_mean"):
            _close(getattr(res, name)[b], getattr(alone, name)[0])  # sink = the first real token
        _close(res.sink_mass[b, ..., :n], alone.sink_mass[0])
        assert int((~res.sink_mass[b, 0, 0].isnan()).sum()) == n - 1  # real queries after the sink only
    frame = res.to_frame()
    assert frame["sink_rate"].notna().all()
    q = res.query_frame(layers=[LAYERS[0]], heads=[0])
    assert len(q) == (4 - 1) + (14 - 1)  # no pad rows
    last = sink_statistics(smollm2, [SHORT, LONG], layers=LAYERS, queries=[-1])
    for b, text in enumerate([SHORT, LONG]):
        n = _n(smollm2, text)
        alone = sink_statistics(smollm2, text, layers=LAYERS)
        _close(last.sink_mass[b, ..., n - 1], alone.sink_mass[0, ..., n - 1])


def test_convexity_check_of_padded_texts_is_the_texts_alone(smollm2, side):
    """The sink-mass intervention of a padded pair (4 and 14 tokens) puts the sink on each text's first real
    token: every measured and closed-form norm is the text run alone's, and no pad is a row."""
    kw = dict(heads=[(3, 0), (3, 5)], s_values=[0.0, 0.5, 1.0])
    check = convexity_check(smollm2, [SHORT, LONG], **kw)
    frame = check.to_frame()
    assert len(frame) == 2 * 3 * ((4 - 1) + (14 - 1))  # real queries after the sink only
    for b, text in enumerate([SHORT, LONG]):
        n = _n(smollm2, text)
        alone = convexity_check(smollm2, text, **kw)
        for key, norm in alone.norms.items():
            _close(check.norms[key][:, b, :n], norm[:, 0])
            assert bool(check.norms[key][:, b, n:].isnan().all())
        mine, ref = frame[frame.text == b].reset_index(drop=True), alone.to_frame()
        assert mine["query"].tolist() == ref["query"].tolist()
        _close(
            torch.tensor(mine["norm_closed_form"].to_numpy()),
            torch.tensor(ref["norm_closed_form"].to_numpy()),
        )
    assert check.summary()["max_rel_error"] < 1e-4
