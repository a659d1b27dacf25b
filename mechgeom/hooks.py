"""Hook factories and the shared tensor maths every analysis imports.

The public currency of mechgeom is the ``(hook_name, fn)`` pair, where ``fn`` is a TransformerLens
hook ``(tensor, hook: HookPoint) -> tensor | None`` on ``blocks.{l}.attn.hook_pattern``, ``hook_v`` or
``hook_z``. Such pairs mix freely with ``transformer_lens.patching`` hooks and the user's own in one
``model.run_with_hooks`` / ``model.hooks(...)`` call.

:class:`LayerCollector` is the reading side: it captures ``pattern``, ``v`` (GQA-expanded) and ``z`` of
one layer, hands them to a per-layer callback as soon as the layer's ``hook_z`` has fired, and drops
them, so an analysis streams over layers and never holds more than one layer's activations.

>>> from mechgeom.hooks import hook_name
>>> hook_name(3, "pattern")
'blocks.3.attn.hook_pattern'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import einops
import torch
from transformer_lens.hook_points import HookPoint

from mechgeom.typing import WO, Float, HeadOut, Pattern, Tensor, Tokens, Values, Z

__all__ = [
    "FwdHook",
    "LayerActivations",
    "LayerCollector",
    "expand_kv",
    "head_outputs",
    "hook_name",
    "layer_W_O",
    "layer_b_O",
    "resolve_heads",
    "resolve_layers",
    "run_hooks",
    "to_tokens",
]

HookKind = Literal["pattern", "v", "z", "attn_out", "q", "k", "result"]
#: A ``(hook_name, fn)`` pair as accepted by ``run_with_hooks(fwd_hooks=...)``.
FwdHook = tuple[str, Callable[..., Any]]


def hook_name(layer: int, kind: HookKind) -> str:
    """The TransformerLens name of an attention hook of ``layer``."""
    if kind == "attn_out":
        return f"blocks.{layer}.hook_attn_out"
    return f"blocks.{layer}.attn.hook_{kind}"


# --------------------------------------------------------------------------- validation


def _n_layers(model: Any) -> int:
    return int(model.cfg.n_layers)


def resolve_layers(model: Any, layers: int | Sequence[int] | None) -> list[int]:
    """``None`` means every layer; an int or a list is checked against ``n_layers``.

    Raises ``IndexError`` for a layer out of range and ``ValueError`` for duplicates or an empty list.
    """
    n = _n_layers(model)
    if layers is None:
        return list(range(n))
    out = [int(layers)] if isinstance(layers, int) else [int(x) for x in layers]
    if not out:
        raise ValueError("layers is empty; pass None for every layer")
    bad = [x for x in out if not 0 <= x < n]
    if bad:
        raise IndexError(f"layer(s) {bad} out of range: the model has {n} layers (0..{n - 1})")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate layers in {out}")
    return out


def resolve_heads(model: Any, heads: int | Sequence[int] | None) -> list[int]:
    """``None`` means every head; otherwise checked against ``n_heads`` like :func:`resolve_layers`."""
    n = int(model.cfg.n_heads)
    if heads is None:
        return list(range(n))
    out = [int(heads)] if isinstance(heads, int) else [int(x) for x in heads]
    if not out:
        raise ValueError("heads is empty; pass None for every head")
    bad = [x for x in out if not 0 <= x < n]
    if bad:
        raise IndexError(f"head(s) {bad} out of range: the model has {n} heads per layer (0..{n - 1})")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate heads in {out}")
    return out


def check_decoder(model: Any) -> None:
    """Raise ``TypeError`` for an encoder (BERT-style) model: the analyses need causal attention."""
    cfg = model.cfg
    if getattr(cfg, "attention_dir", "causal") != "causal" or "Encoder" in type(model).__name__:
        raise TypeError(
            f"{type(model).__name__} is not a causal decoder (attention_dir="
            f"{getattr(cfg, 'attention_dir', None)!r}); mechgeom's analyses need causal self-attention"
        )


def to_tokens(model: Any, tokens_or_text: str | Sequence[str] | Tensor) -> Tokens:
    """Token ids ``[batch, pos]`` from text (the model's own tokenizer and BOS default) or a tensor.

    Raises ``ValueError`` for empty text or an empty tensor, and for sequences longer than ``n_ctx``.
    """
    check_decoder(model)
    if isinstance(tokens_or_text, str) or (
        isinstance(tokens_or_text, Sequence) and not isinstance(tokens_or_text, Tensor)
    ):
        texts = [tokens_or_text] if isinstance(tokens_or_text, str) else list(tokens_or_text)
        if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
            raise ValueError("empty text: give at least one non-blank string")
        tokens = model.to_tokens(texts if len(texts) > 1 else texts[0], truncate=False)
    else:
        tokens = tokens_or_text
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, pos], got shape {tuple(tokens.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError("empty input: no tokens")
    n_ctx = int(model.cfg.n_ctx)
    if tokens.shape[1] > n_ctx:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the model's n_ctx={n_ctx}")
    return tokens.to(model.cfg.device)


# --------------------------------------------------------------------------- shared maths


def expand_kv(v: Float[Tensor, "batch pos kv_head d_head"], n_heads: int) -> Values:
    """Expand GQA values (one per KV head) to one per query head: ``repeat_interleave`` on dim 2.

    >>> expand_kv(torch.arange(3.0).view(1, 1, 3, 1), 9)[0, 0, :, 0].tolist()
    [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    """
    n_kv = v.shape[2]
    if n_kv == n_heads:
        return v
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} heads are not a multiple of {n_kv} KV heads")
    return v.repeat_interleave(n_heads // n_kv, dim=2)


def layer_W_O(model: Any, layer: int) -> WO:
    """``W_O`` of one layer, ``[head_index, d_head, d_model]``, read from the model's weights."""
    return model.blocks[layer].attn.W_O


def layer_b_O(model: Any, layer: int) -> Float[Tensor, " d_model"]:
    """``b_O`` of one layer, or zeros where the model has none (a bridge over LLaMA)."""
    bias = getattr(model.blocks[layer].attn, "b_O", None)
    if isinstance(bias, Tensor):
        return bias
    W_O = layer_W_O(model, layer)
    return torch.zeros(W_O.shape[-1], dtype=W_O.dtype, device=W_O.device)


def head_outputs(z: Z, W_O: WO) -> HeadOut:
    """Per-head outputs ``o[i,h] = z[i,h] @ W_O[h]`` (bias excluded), ``[batch, pos, head, d_model]``."""
    return einops.einsum(z, W_O, "batch pos head d_head, head d_head d_model -> batch pos head d_model")


# --------------------------------------------------------------------------- collecting


@dataclass
class LayerActivations:
    """One layer's attention activations, as seen by the hooks (``v`` already GQA-expanded)."""

    layer: int
    pattern: Pattern
    v: Values
    z: Z
    W_O: WO
    b_O: Float[Tensor, " d_model"]


class LayerCollector:
    """Reads ``hook_pattern``, ``hook_v`` and ``hook_z`` of chosen layers; streams them to ``on_layer``.

    ``fwd_hooks`` is an ordinary list of ``(name, fn)`` pairs: pass it to ``model.run_with_hooks``,
    ``model.hooks(fwd_hooks=...)`` or ``run_with_cache``'s ``model.hooks`` context, beside any other
    hook. The hooks only read (they return ``None``), so they change nothing downstream. When a
    layer's three activations have arrived, ``on_layer(LayerActivations)`` runs and the activations
    are released.
    """

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        on_layer: Callable[[LayerActivations], None] | None = None,
        *,
        detach: bool = True,
    ) -> None:
        self.model = model
        self.layers = resolve_layers(model, layers)
        self.on_layer = on_layer
        self.detach = detach
        self._pending: dict[int, dict[str, Tensor]] = {}
        self.captured: dict[int, LayerActivations] = {}

    def _store(self, tensor: Tensor, hook: HookPoint, *, layer: int, kind: str) -> None:
        # tensor: pattern [batch head q k] | v [batch pos kv_head d_head] | z [batch pos head d_head]
        slot = self._pending.setdefault(layer, {})
        slot[kind] = tensor.detach() if self.detach else tensor
        if len(slot) == 3:
            del self._pending[layer]
            acts = LayerActivations(
                layer=layer,
                pattern=slot["pattern"],
                v=expand_kv(slot["v"], int(self.model.cfg.n_heads)),
                z=slot["z"],
                W_O=layer_W_O(self.model, layer).detach(),
                b_O=layer_b_O(self.model, layer).detach(),
            )
            if self.on_layer is None:
                self.captured[layer] = acts
            else:
                self.on_layer(acts)

    @property
    def fwd_hooks(self) -> list[FwdHook]:
        """The ``(hook_name, fn)`` pairs, three per layer."""
        from functools import partial

        hooks: list[FwdHook] = []
        for layer in self.layers:
            for kind in ("v", "pattern", "z"):
                hooks.append((hook_name(layer, kind), partial(self._store, layer=layer, kind=kind)))  # type: ignore[arg-type]
        return hooks

    def feed_cache(self, cache: Any) -> None:
        """Replay an ``ActivationCache`` (or a dict of activations) through the same path as the hooks."""
        for layer in self.layers:
            for kind in ("v", "pattern", "z"):
                name = hook_name(layer, kind)
                try:
                    tensor = cache[name]
                except KeyError:
                    raise KeyError(
                        f"the cache has no {name!r}; run run_with_cache with names_filter covering "
                        "hook_pattern, hook_v and hook_z of the layers you analyse"
                    ) from None
                self._store(tensor, None, layer=layer, kind=kind)  # type: ignore[arg-type]


def run_hooks(
    model: Any,
    tokens: Tokens,
    fwd_hooks: Sequence[FwdHook],
    *,
    return_type: str | None = None,
    stop_at_layer: int | None = None,
) -> Any:
    """One forward pass with ``fwd_hooks``; the hooks are removed afterwards, also if a hook raises."""
    kwargs: dict[str, Any] = {"return_type": return_type}
    if stop_at_layer is not None:
        kwargs["stop_at_layer"] = stop_at_layer
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks), reset_hooks_end=True):
        return model(tokens, **kwargs)


def has_hooks(model: Any) -> bool:
    """Whether any forward hook is still attached to one of the model's hook points."""
    return any(len(hp.fwd_hooks) > 0 for hp in model.hook_dict.values())
