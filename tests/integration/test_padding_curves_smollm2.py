"""Padding in the ΔPPL sweep on the real SmolLM2-135M (issue 35): texts of different lengths in one batch,
padded on the left or on the right, give each text the numbers it has run alone.

The issue's example: ``perplexity_curves(["The cat sat.", ioi])`` reported a clean PPL of 106.9, while
the two texts alone have 36370.8 and 67.9: the padding was scored as text.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from mechgeom import hooks as mg_hooks
from mechgeom.analyses.faithfulness.curves import perplexity_curves
from mechgeom.analyses.scoring import perplexity, text_nll
from mechgeom.hooks import has_hooks

pytestmark = pytest.mark.integration

CAT = "The cat sat."
IOI = "When Mary and John went to the store, John gave a drink to"
#: The texts alone (SmolLM2-135M, float32, CPU), as the issue measured them.
ALONE_PPL = {CAT: 36370.8, IOI: 67.89}
SWEEP = dict(
    metrics=["contribution", "random"],
    rates=[0.0, 0.5],
    modes=["comprehensiveness"],
    layers=[2, 5],
    n_boot=20,
    per_text=True,
)


@pytest.fixture(params=["right", "left"])
def padding_side(request: pytest.FixtureRequest, smollm2) -> Iterator[str]:
    """The tokenizer's padding side for one test (restored afterwards)."""
    before = smollm2.tokenizer.padding_side
    smollm2.tokenizer.padding_side = request.param
    try:
        yield str(request.param)
    finally:
        smollm2.tokenizer.padding_side = before


def test_smollm2_texts_alone_have_the_issue_numbers(smollm2) -> None:
    for text, ppl in ALONE_PPL.items():
        assert perplexity(smollm2, smollm2.to_tokens(text)) == pytest.approx(ppl, rel=1e-4)


def test_smollm2_padded_batch_scores_each_text_as_alone(smollm2, padding_side) -> None:
    texts = [CAT, IOI]
    sweep = {k: v for k, v in SWEEP.items() if k != "per_text"}
    # the pooled PPL keeps docs/definitions.md §3.4: exp of the mean over texts of each text's mean NLL
    table = perplexity_curves(smollm2, texts, **sweep)
    pooled = math.exp((math.log(ALONE_PPL[CAT]) + math.log(ALONE_PPL[IOI])) / 2)  # 1571.4
    assert table["clean_ppl"].iloc[0] == pytest.approx(pooled, rel=1e-4)  # not 106.9 (pads scored)
    # the batch: the short text is padded on the tokenizer's side
    tokens, mask = mg_hooks.to_batch(smollm2, texts)
    assert mask is not None and mask.sum(-1).tolist() == [4, 14]
    assert not bool(mask[0, 0 if padding_side == "left" else -1])
    # the scoring layer: each text's mean NLL over its own predictions
    nll = text_nll(smollm2, tokens, attention_mask=mask)
    np.testing.assert_allclose(nll.exp().numpy(), [ALONE_PPL[CAT], ALONE_PPL[IOI]], rtol=1e-4)
    # the sweep: per-text clean PPL and every curve point as alone, to 1e-5 relative
    batched = perplexity_curves(smollm2, texts, **SWEEP)
    for t, text in enumerate(texts):
        alone = perplexity_curves(smollm2, [text], **SWEEP).reset_index(drop=True)
        mine = batched[batched["text"] == t].reset_index(drop=True)
        assert mine["clean_ppl"].iloc[0] == pytest.approx(ALONE_PPL[text], rel=1e-4)
        assert (mine["n_pred"] == len(smollm2.to_tokens(text)[0]) - 1).all()
        np.testing.assert_allclose(mine["clean_ppl"], alone["clean_ppl"], rtol=1e-5)
        np.testing.assert_allclose(mine["ppl"], alone["ppl"], rtol=1e-5)
        assert (mine["unit_hash"] == alone["unit_hash"]).all()
    assert not has_hooks(smollm2)
