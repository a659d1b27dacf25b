"""Padding and ``queries=`` in contribution weights on the real SmolLM2-135M, left and right padding (issue 35).

The reference is each text run alone: per-text summaries, table rows and kept query rows must equal it
(1e-5 relative, float32), and the batch summary must equal the alone runs pooled. The issue's example is
``contribution_weights(model, ["The cat sat.", ioi_text]).summary()``: its sink attention mixed padding in.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from mechgeom.analyses.contribution.overview import contribution_overview
from mechgeom.analyses.contribution.stats import SUMMARY_METRICS, ScoreTotals, overview_summary
from mechgeom.analyses.contribution.weights import contribution_weights

pytestmark = pytest.mark.integration

IOI = "When Mary and John went to the store, John gave a drink to"
TEXTS = ["The cat sat.", IOI, "Paris is the capital of"]
LAYERS = [0, 3, 11, 29]
METRICS = list(SUMMARY_METRICS)


@pytest.fixture(params=["left", "right"])
def side(request, smollm2, monkeypatch):
    monkeypatch.setattr(smollm2.tokenizer, "padding_side", request.param)
    return request.param


@pytest.fixture(scope="module")
def alone(smollm2):
    return [contribution_weights(smollm2, t, layers=LAYERS, intra=METRICS, inter=METRICS) for t in TEXTS]


def _pooled_summary(results) -> dict:
    """The summary of the alone runs pooled: every (sum, count) pair added, then the same means."""
    totals = ScoreTotals()
    for r in results:
        for li, layer in enumerate(r.layers):
            totals.add(
                layer, {k: v[:, li] for k, v in r.intra.items()}, {k: v[:, li] for k, v in r.inter.items()}
            )
    return overview_summary(totals.heads_frame(), totals.layers_frame(), len(results))


def test_issue_example_summary_per_text_and_pooled(smollm2, alone, side):
    res = contribution_weights(smollm2, TEXTS, layers=LAYERS, intra=METRICS, inter=METRICS)
    assert res.key_mask is not None  # the texts have different lengths
    pad_first = side == "left"
    assert bool(res.key_mask[0, 0]) is not pad_first
    got, want = res.summary(), _pooled_summary(alone)  # the batch pools its texts, padding left out
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for b, a in enumerate(alone):  # and each text's summary is the text alone's
        got, want = res.summary(batch=b), a.summary()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (b, k)


def test_table_of_a_padded_batch_equals_the_texts_alone(smollm2, alone, side):
    res = contribution_weights(smollm2, TEXTS, layers=LAYERS, intra=METRICS, inter=METRICS)
    for b, a in enumerate(alone):
        for query in (None, -1):
            got = res.to_frame(batch=b, layers=[3], query=query).drop(columns="batch")
            want = a.to_frame(layers=[3], query=query).drop(columns="batch")
            # entries of another forward pass (batch-dependent kernels on the bridge: up to 1.2e-6 measured)
            pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-5, atol=1e-5)


def test_last_query_rows_of_a_padded_batch_equal_each_text_alone(smollm2, side):
    layers = [2, 20]
    res = contribution_weights(smollm2, TEXTS, layers=layers, queries=[-1])
    assert res.query_index is not None and res.query_index.shape == (3, 1)
    for b, text in enumerate(TEXTS):
        a = contribution_weights(smollm2, text, layers=layers)
        n = a.shape[2]
        real = res.key_mask[b].cpu()
        assert int(res.query_index[b, 0]) == int(real.nonzero().flatten()[-1])
        for k, v in a.intra.items():
            got = res.intra[k][b][:, :, 0][..., real]  # [layer head key], real keys only
            torch.testing.assert_close(got, v[0][:, :, n - 1], rtol=1e-5, atol=2e-5, equal_nan=True, msg=k)
        for k, v in a.inter.items():
            got = res.inter[k][b][:, 0][..., real]
            torch.testing.assert_close(got, v[0][:, n - 1], rtol=1e-5, atol=2e-5, equal_nan=True, msg=k)
        # the table of the kept row is the alone table of its last query
        got = res.to_frame(batch=b, layers=[20]).drop(columns="batch")
        want = a.to_frame(layers=[20], query=-1).drop(columns="batch")
        pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-5, atol=2e-5)


def test_overview_of_padded_texts_pools_the_texts_alone(smollm2, alone, side):
    ov = contribution_overview(smollm2, TEXTS, layers=LAYERS, batch_size=2)
    got, want = ov.summary(), _pooled_summary(alone)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
