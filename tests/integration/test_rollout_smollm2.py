"""Attention rollout on the real SmolLM2-135M (a few texts, a few layers) against the brute force of its
definition, and as a layer-level score that sums to 1 over each query's sources."""

from __future__ import annotations

import pytest
import torch

from mechgeom import attention_rollout
from mechgeom.hooks import has_hooks

pytestmark = pytest.mark.integration


def test_rollout_matches_the_brute_force_on_smollm2(smollm2, smollm2_windows) -> None:  # type: ignore[no-untyped-def]
    tokens = smollm2_windows[:2, :24]
    layers = [1, 4, 9]
    res = attention_rollout(smollm2, tokens, layers=layers)
    names = [f"blocks.{la}.attn.hook_pattern" for la in range(max(layers))]
    _, cache = smollm2.run_with_cache(tokens, names_filter=lambda n: n in names, stop_at_layer=max(layers))
    q = tokens.shape[1]
    eye = torch.eye(q, dtype=torch.float64)
    for b in range(tokens.shape[0]):
        r = eye.clone()
        for la in range(max(layers)):
            if la in layers:
                torch.testing.assert_close(res.scores[b, layers.index(la)].double(), r, atol=2e-5, rtol=0)
            a = 0.5 * cache[names[la]][b].double().mean(0) + 0.5 * eye
            r = (a / a.sum(-1, keepdim=True)) @ r
        torch.testing.assert_close(res.scores[b, -1].double(), r, atol=2e-5, rtol=0)
    torch.testing.assert_close(res.scores.sum(-1), torch.ones(2, 3, q), atol=1e-5, rtol=0)
    first = res.summary()["first_token_share"]
    assert first[0] < first[-1]  # the first token's share of the residual grows with depth
    assert not has_hooks(smollm2)
