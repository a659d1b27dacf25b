"""Interventions take effect, or refuse (issue 36 point 3): never nothing silently.

Every intervention mechgeom offers (source masking and the sink mass on ``hook_pattern``, the sink value on
``hook_v``, head removal on ``hook_z``) on every backend the installed TransformerLens line has: a
``HookedTransformer`` and a ``HookedEncoder`` (3.x), ``TransformerBridge.boot_native`` decoders and encoders,
and bridges around a random Hugging Face Qwen2 and BERT. Either the logits move, or building the hooks raises a
``RuntimeError`` that names the backend and the hook point, and then the bare edit at that hook point (zeroing
it) indeed leaves the logits as they are: the refusal is never a guess.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED, make_hooked_encoder, make_tiny, make_tiny_hf_bridge, random_tokens

from mechgeom.hooks.interventions import head_ablation_hooks, masking_hooks, sink_mass_hooks, sink_value_hooks
from mechgeom.models.adapter import adapter


def _native_bridge(attention_dir: str) -> Any:
    """``TransformerBridge.boot_native`` on either line (``make_tiny`` gives one on 3.x only for an encoder)."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        n_layers=2, d_model=16, n_ctx=16, d_head=4, n_heads=4, d_mlp=32, act_fn="gelu", d_vocab=50,
        normalization_type="LN", attention_dir=attention_dir, seed=0,
    )  # fmt: skip
    return TransformerBridge.boot_native(cfg).eval()


#: name -> (builder, TransformerLens 3.x only)
BACKENDS: dict[str, tuple[Callable[[], Any], bool]] = {
    "hooked": (lambda: make_tiny(), True),
    "hooked_encoder": (make_hooked_encoder, True),
    "bridge_native": (lambda: _native_bridge("causal"), False),
    "bridge_native_encoder": (lambda: _native_bridge("bidirectional"), False),
    "bridge_hf_qwen2": (make_tiny_hf_bridge, False),
    "bridge_hf_bert": (lambda: make_tiny_hf_bridge("bert"), False),
}

#: name -> (hook point it edits, builder of its hooks for a model and tokens)
INTERVENTIONS: dict[str, tuple[str, Callable[[Any, torch.Tensor], list]]] = {
    "source_masking": (
        "hook_pattern",
        lambda m, t: masking_hooks(
            m, mask=torch.eye(t.shape[1], dtype=torch.bool)[None].expand(t.shape[0], -1, -1)
        ),
    ),
    "sink_mass": ("hook_pattern", lambda m, t: sink_mass_hooks(m, 0.05)),
    "sink_value": ("hook_v", lambda m, t: sink_value_hooks(m, mode="scale", scale=5.0)),
    "head_removal": ("hook_z", lambda m, t: head_ablation_hooks(m, [(0, 0), (0, 1), (1, 2)])),
}

_MODELS: dict[str, Any] = {}


def _model(name: str) -> Any:
    build, hooked_only = BACKENDS[name]
    if hooked_only and not HAS_HOOKED:
        pytest.skip("HookedTransformer and HookedEncoder exist on TransformerLens 3.x only")
    if name not in _MODELS:
        _MODELS[name] = build()
    return _MODELS[name]


def _logits(model: Any, tokens: torch.Tensor, hooks: list) -> torch.Tensor:
    with warnings.catch_warnings(), torch.no_grad(), model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        warnings.simplefilter("ignore")  # a bridge may warn that it discards an edit: the test looks
        return model(tokens)


@pytest.mark.parametrize("intervention", list(INTERVENTIONS))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_an_intervention_changes_the_logits_or_refuses_naming_backend_and_hook(
    backend: str, intervention: str
) -> None:
    model = _model(backend)
    tokens = (
        random_tokens(batch=2, pos=6, d_vocab=47, seed=5) + 3
    )  # no padding, BOS or special id of the Qwen2 tokenizer
    point, build = INTERVENTIONS[intervention]
    clean = _logits(model, tokens, [])
    try:
        hooks = build(model, tokens)
    except RuntimeError as err:
        msg = str(err)
        assert adapter(model).name in msg and f".attn.{point}" in msg, msg
        layer = int(msg.split("blocks.")[1].split(".")[0])
        bare = [(f"blocks.{layer}.attn.{point}", lambda x, hook: torch.zeros_like(x))]
        torch.testing.assert_close(_logits(model, tokens, bare), clean)  # the edit would indeed do nothing
        return
    assert hooks and all(name.endswith(point) or name.endswith("hook_z") for name, _ in hooks)
    changed = float((_logits(model, tokens, hooks) - clean).abs().max())
    assert changed > 1e-3, f"{intervention} on {adapter(model).name} changed the logits by {changed:.1e} only"
