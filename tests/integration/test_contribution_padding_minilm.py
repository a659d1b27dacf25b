"""Padding and ``queries=`` in contribution weights on the real encoder all-MiniLM-L6-v2 (issue 35).

A list of texts is right-padded with ``[PAD]`` by the tokenizer; left padding is built by hand with an
``attention_mask``. Either way every per-text number must equal the text run alone: the ``[CLS]``/``[SEP]``
summary, the table (real positions, numbered inside the text) and the kept query rows.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import pad_rows

from mechgeom.analyses.contribution.weights import contribution_weights
from mechgeom.hooks import to_tokens

pytestmark = pytest.mark.integration

TEXTS = ["A man is eating food.", "Hi", "The capital of France is Paris, a city of many bridges."]
LAYERS = [0, 5]


def _batch(model, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [to_tokens(model, t, encoders=True)[0].cpu() for t in TEXTS]
    return pad_rows(rows, side, int(model.tokenizer.pad_token_id))


def _check_alone(res, rows, b: int, a) -> None:
    """Text ``b`` of ``res`` (and of ``rows``, its queries 0 and -1) against ``a``, the text alone."""
    got, want = res.summary(batch=b), a.summary()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (b, k)
    for frame, query in ((res, None), (rows, [0, -1])):
        g = frame.to_frame(batch=b, layers=[5]).drop(columns="batch")
        w = a.to_frame(layers=[5], query=query).drop(columns="batch")
        pd.testing.assert_frame_equal(g, w, check_exact=False, rtol=1e-5, atol=2e-5)


def test_right_padded_encoder_batch_equals_each_text_alone(minilm):
    """The tokenizer's own padding ([PAD] on the right): every per-text number is the text alone's."""
    toks, mask = _batch(minilm, "right")
    res = contribution_weights(minilm, toks, attention_mask=mask, layers=LAYERS)
    rows = contribution_weights(minilm, toks, attention_mask=mask, layers=LAYERS, queries=[0, -1])
    for b, text in enumerate(TEXTS):
        _check_alone(res, rows, b, contribution_weights(minilm, text, layers=LAYERS))
    assert res.summary(batch=1)["n_texts"] == 1


def test_left_padded_encoder_batch_equals_each_text_alone(minilm):
    """Left padding: BERT's absolute positions are not shifted by the mask (TransformerLens 3's HookedEncoder
    and the bridge alike), so a left-padded text would be read at other positions than alone (attention off by
    up to 0.67 in layer 0, measured). mechgeom right-aligns an encoder's batch first
    (:func:`mechgeom.hooks.right_align`), so each text's numbers equal the text run alone."""
    toks, mask = _batch(minilm, "left")
    assert not bool(mask[:, 0].all())  # some text really is left-padded
    res = contribution_weights(minilm, toks, attention_mask=mask, layers=LAYERS)
    rows = contribution_weights(minilm, toks, attention_mask=mask, layers=LAYERS, queries=[0, -1])
    assert bool(res.key_mask[:, 0].all())  # right-aligned: every text starts at position 0
    for b, text in enumerate(TEXTS):
        _check_alone(res, rows, b, contribution_weights(minilm, text, layers=LAYERS))
