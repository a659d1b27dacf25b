"""The backend adapter: every backend-specific fact the hooks and analyses need, asked of one object.

mechgeom runs on three TransformerLens model classes: ``HookedTransformer`` and ``HookedEncoder``
(TransformerLens 3.x only) and ``TransformerBridge`` (both lines; the only one on 4.x, in compatibility mode
for the offline models). They share hook names, but not everything an analysis relies on:

- **encoder or decoder**: bidirectional attention (``cfg.attention_dir``, or a ``HookedEncoder``);
- **the forward's arguments**: a ``HookedEncoder`` takes ``one_zero_attention_mask`` and has no
  ``stop_at_layer``; a bidirectional ``HookedTransformer`` ignores padding masks (TransformerLens applies them
  together with the causal mask only), so padding would be attended: refused;
- **resuming at a layer**: only a ``HookedTransformer`` (without shortformer positions) runs from
  ``blocks.{l}.hook_resid_pre`` with ``start_at_layer=l`` and skips the earlier blocks; a bridge has no
  ``start_at_layer`` (3.x) or still runs the earlier blocks (4.x);
- **the attention's output**: Gemma-2 and -3 normalise it (``ln1_post``) before ``hook_attn_out`` reads it;
- **unembedding**: ``W_U``, ``b_U``, the final norm and the logit soft cap; a ``HookedTransformer``'s
  ``stop_at_layer=n_layers`` gives the residual stream before the final norm, so chosen positions can be
  unembedded alone (a bridge's gives the logits);
- **the value bias** ``b_V`` (per query head), which ``hook_v`` includes wherever the model keeps it;
- **interventions**: whether a zeroed ``hook_pattern`` (or ``hook_v``, ``hook_z``) reaches the output.
  TransformerLens 3.x's ``boot_native`` and BERT bridges discard ``hook_pattern`` edits (their attention runs
  in the HF module; a 3.x bridge over an eager Qwen2 honours them), as does TransformerLens 4's BERT bridge
  (it fires the hook after HF's attention has run); one probe pass per model, layer and hook point finds out,
  and :meth:`ModelAdapter.check_edits` turns a discarded edit into an error naming backend and hook point.

:func:`adapter` gives the one :class:`ModelAdapter` of a model (cached while the model lives). Above this
layer no module tests a class name, :func:`is_bridge` or the TransformerLens version
(``tests/unit/test_backend_unit.py`` checks the source).

>>> from types import SimpleNamespace
>>> a = adapter(SimpleNamespace(cfg=SimpleNamespace(attention_dir="bidirectional")))
>>> a.kind, a.is_encoder, a.is_bridge
('other', True, False)
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from importlib.metadata import version as _dist_version
from typing import Any, Literal

import torch

from mechgeom.typing import Bool, Float, Tensor, Tokens

__all__ = [
    "TL_VERSION",
    "BackendKind",
    "ModelAdapter",
    "adapter",
    "is_bridge",
    "is_encoder",
]

#: The installed TransformerLens version; ``HookedTransformer`` and ``HookedEncoder`` exist on 3.x only.
TL_VERSION: str = _dist_version("transformer-lens")

#: The model classes the adapter tells apart; ``"other"`` is anything else with a ``cfg`` (duck-typed).
BackendKind = Literal["hooked", "hooked_encoder", "bridge", "other"]

#: A ``(hook_name, fn)`` pair as ``model.hooks(fwd_hooks=...)`` takes it.
Edit = tuple[str, Callable[..., Any]]


@functools.cache
def _tl_classes() -> tuple[tuple[BackendKind, type], ...]:
    """The installed TransformerLens model classes, a bridge first."""
    found: list[tuple[BackendKind, type]] = []
    try:
        from transformer_lens.model_bridge import TransformerBridge

        found.append(("bridge", TransformerBridge))
    except ImportError:  # pragma: no cover - every supported TransformerLens has the bridge
        pass
    try:  # TransformerLens 3.x; 4.0 removed both (importing them raises ImportError there)
        from transformer_lens import HookedEncoder, HookedTransformer

        found += [("hooked_encoder", HookedEncoder), ("hooked", HookedTransformer)]
    except ImportError:
        pass
    return tuple(found)


def _kind(model: Any) -> BackendKind:
    return next((kind for kind, cls in _tl_classes() if isinstance(model, cls)), "other")


def _zero(x: Tensor, hook: Any) -> Tensor:
    return torch.zeros_like(x)


class ModelAdapter:
    """What mechgeom asks of a model's backend; get it with :func:`adapter` (one per model).

    The answers that need a forward pass (:meth:`pattern_edits_take_effect`) are cached; the others are read
    from the model each time, so they follow ``model.to(...)`` and config changes. The adapter holds the
    model weakly where it can.
    """

    def __init__(self, model: Any) -> None:
        try:
            self._ref: Callable[[], Any] = weakref.ref(model)
        except TypeError:  # e.g. a SimpleNamespace: held strongly (such adapters are not cached)
            self._ref = lambda: model
        #: ``"hooked"`` (``HookedTransformer``), ``"hooked_encoder"`` (``HookedEncoder``), ``"bridge"``
        #: (``TransformerBridge``) or ``"other"``.
        self.kind: BackendKind = _kind(model)
        self._pattern_edits: dict[int, bool] = {}
        self._other_edits: dict[tuple[str, int], bool] = {}
        self._value_bias_nonzero: dict[int, tuple[tuple[Any, ...], bool]] = {}

    @property
    def model(self) -> Any:
        """The model (``ReferenceError`` once it has been garbage-collected)."""
        model = self._ref()
        if model is None:
            raise ReferenceError("the model of this adapter no longer exists")
        return model

    @property
    def name(self) -> str:
        """The backend in words, for messages: the class and the TransformerLens version."""
        return f"{type(self.model).__name__} (TransformerLens {TL_VERSION})"

    # ------------------------------------------------------------------ kind

    @property
    def is_bridge(self) -> bool:
        """Whether the model is a TransformerLens ``TransformerBridge`` (the only backend on 4.x)."""
        return self.kind == "bridge"

    @property
    def is_encoder(self) -> bool:
        """Whether the model attends both ways (BERT-style): ``cfg.attention_dir == "bidirectional"`` or a
        ``HookedEncoder``."""
        cfg = getattr(self.model, "cfg", None)
        return getattr(cfg, "attention_dir", "causal") == "bidirectional" or self.kind == "hooked_encoder"

    def _first_parameter(self) -> Tensor | None:
        params = getattr(self.model, "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        return first if isinstance(first, Tensor) else None

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (``cfg.device`` for a model without parameters)."""
        first = self._first_parameter()
        return (
            first.device
            if first is not None
            else torch.device(getattr(self.model.cfg, "device", None) or "cpu")
        )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (``cfg.dtype`` for a model without parameters)."""
        first = self._first_parameter()
        return first.dtype if first is not None else getattr(self.model.cfg, "dtype", None) or torch.float32

    # ------------------------------------------------------------------ the forward pass

    @property
    def supports_stop_at_layer(self) -> bool:
        """Whether the forward takes ``stop_at_layer`` (all but a ``HookedEncoder``, which runs every layer)."""
        return self.kind != "hooked_encoder"

    @property
    def supports_start_at_layer(self) -> bool:
        """Whether ``model(resid, start_at_layer=l, tokens=...)`` runs from ``blocks.{l}.hook_resid_pre`` and
        skips the earlier blocks: a ``HookedTransformer`` whose positions are not shortformer's (those are
        added to every layer's queries and keys, and would need ``shortformer_pos_embed``). A bridge has no
        ``start_at_layer`` on TransformerLens 3.x and still runs the earlier blocks with it on 4.x; a
        ``HookedEncoder`` has none."""
        pos = getattr(self.model.cfg, "positional_embedding_type", "")
        return self.kind == "hooked" and pos != "shortformer"

    @property
    def honours_attention_mask(self) -> bool:
        """Whether a padding mask keeps padded keys out of the attention: not on a bidirectional
        ``HookedTransformer`` (TransformerLens applies the mask together with the causal mask only)."""
        return not (self.kind == "hooked" and self.is_encoder)

    def check_attention_mask(self) -> None:
        """Raise ``ValueError`` where the model would attend to padding (:attr:`honours_attention_mask`)."""
        if not self.honours_attention_mask:
            raise ValueError(
                "a bidirectional HookedTransformer ignores attention masks (TransformerLens applies them with "
                "the causal mask only), so padding would be attended; use a HookedEncoder or a bridge"
            )

    def forward_kwargs(
        self,
        *,
        return_type: str | None = "logits",
        stop_at_layer: int | None = None,
        attention_mask: Bool[Tensor, "batch pos"] | Tensor | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments of ``model(tokens, **kwargs)`` on this backend.

        Args:
            return_type: passed as it is (``None``: run the blocks for their hooks only).
            stop_at_layer: stop before that block where the backend can (:attr:`supports_stop_at_layer`);
                a ``HookedEncoder`` runs the whole model.
            attention_mask: ``[batch, pos]``, 1/``True`` for a real token; given as ``one_zero_attention_mask``
                to a ``HookedEncoder`` and as ``attention_mask`` to the others, in ``torch.long``.

        Raises:
            ValueError: a mask for a model that would attend to padding anyway (:meth:`check_attention_mask`).

        >>> from types import SimpleNamespace
        >>> adapter(SimpleNamespace(cfg=SimpleNamespace())).forward_kwargs(return_type=None, stop_at_layer=2)
        {'return_type': None, 'stop_at_layer': 2}
        """
        kwargs: dict[str, Any] = {"return_type": return_type}
        if stop_at_layer is not None and self.supports_stop_at_layer:
            kwargs["stop_at_layer"] = stop_at_layer
        if attention_mask is not None:
            self.check_attention_mask()
            key = "one_zero_attention_mask" if self.kind == "hooked_encoder" else "attention_mask"
            kwargs[key] = attention_mask.to(torch.long)
        return kwargs

    # ------------------------------------------------------------------ unembedding

    @property
    def unembeds_positions(self) -> bool:
        """Whether chosen positions can be unembedded alone: ``model(tokens, stop_at_layer=n_layers)`` gives
        the residual stream before the final norm, which :meth:`logits` maps to the full forward's logits
        (a ``HookedTransformer``; a bridge's ``stop_at_layer=n_layers`` already gives the logits)."""
        return self.kind == "hooked"

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """The unembedding matrix."""
        return self.model.W_U

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        """The unembedding bias (zeros where the model has none)."""
        bias = getattr(self.model, "b_U", None)
        if isinstance(bias, Tensor):
            return bias
        W_U = self.W_U
        return torch.zeros(W_U.shape[-1], dtype=W_U.dtype, device=W_U.device)

    @property
    def final_norm(self) -> torch.nn.Module | None:
        """The norm between the last block and the unembedding (``ln_final``), ``None`` where there is none
        (no normalisation, or a ``HookedEncoder``, whose LayerNorms are inside the blocks)."""
        norm = getattr(self.model, "ln_final", None)
        return norm if isinstance(norm, torch.nn.Module) else None

    @property
    def final_norm_scale_hook(self) -> str | None:
        """The hook that reads the final norm's scale (``ln_final.hook_scale``), ``None`` where it has none."""
        name = "ln_final.hook_scale"
        return name if name in getattr(self.model, "hook_dict", {}) else None

    @property
    def logit_soft_cap(self) -> float | None:
        """Gemma's soft cap ``c`` of ``c * tanh(logits / c)``; ``None`` where the logits are not capped."""
        cap = getattr(self.model.cfg, "output_logits_soft_cap", None)
        return float(cap) if cap is not None and cap > 0 else None

    def logits(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_vocab"]:
        """The logits of residual-stream vectors read before the final norm: :attr:`final_norm`, the
        unembedding, then :attr:`logit_soft_cap`. ``TypeError`` on an encoder (its logits come from an MLM
        head, which mechgeom does not model)."""
        if self.is_encoder:
            raise TypeError(f"{self.name} is an encoder: its logits come from an MLM head, not W_U")
        from transformer_lens.utilities.activation_functions import apply_softcap

        norm = self.final_norm
        x = norm(resid) if norm is not None else resid
        return apply_softcap(self.model.unembed(x), self.model.cfg.output_logits_soft_cap)

    # ------------------------------------------------------------------ the attention's output

    def attn_out_norm(self, layer: int) -> torch.nn.Module | None:
        """The norm between the attention's output projection and ``blocks.{layer}.hook_attn_out``: Gemma-2 and
        Gemma-3's post-attention RMSNorm (``blocks.{layer}.ln1_post``, on a ``HookedTransformer`` and a bridge
        alike), ``None`` where ``hook_attn_out`` reads ``sum_h z W_O + b_O`` itself.

        The contribution weights are of the output before that norm (``docs/definitions.md``); only what
        ``hook_attn_out`` reads passes through it.
        """
        norm = getattr(self.model.blocks[layer], "ln1_post", None)
        return norm if isinstance(norm, torch.nn.Module) else None

    def attention_window(self, layer: int) -> int | None:
        """The width ``W`` of a sliding-window (local) attention layer, whose query ``i`` sees the keys
        ``i - W < j <= i`` only (Mistral, Gemma-2/3's local layers); ``None`` for a global layer.

        A ``HookedTransformer`` says it in ``cfg.use_local_attn`` / ``cfg.attn_types[layer] == "local"`` and
        ``cfg.window_size``; a bridge keeps its Hugging Face config: ``sliding_window`` with ``layer_types``
        (``"sliding_attention"`` layers), or, without ``layer_types``, on every layer unless
        ``use_sliding_window`` is ``False`` (Qwen2's default). Both mask ``j <= i - W`` the same way.
        """
        cfg = self.model.cfg
        if getattr(cfg, "use_local_attn", False) and isinstance(getattr(cfg, "window_size", None), int):
            types = getattr(cfg, "attn_types", None)
            return int(cfg.window_size) if types is None or types[layer] == "local" else None
        hf = getattr(getattr(self.model, "original_model", None), "config", None)
        width = getattr(hf, "sliding_window", None) if hf is not None else None
        if not isinstance(width, int) or width <= 0 or getattr(hf, "use_sliding_window", True) is False:
            return None
        types = getattr(hf, "layer_types", None)
        if types is None:
            return width
        return width if types[layer] == "sliding_attention" else None

    # ------------------------------------------------------------------ interventions

    def value_bias(self, layer: int) -> Float[Tensor, "head_index d_head"] | None:
        """The value bias ``b_V`` of ``layer``, one row per query head (GQA: each KV head's bias repeated
        over its group), detached; ``None`` where the attention has none or it is zero (folded). Whether it is
        zero is looked at once per layer and weight version (a host read only when the weights change).

        ``hook_v`` holds ``x W_V + b_V`` on every backend that has ``b_V`` (``blocks.{l}.attn.b_V``: a
        ``HookedTransformer`` stores it per query head, a bridge per KV head); a model whose value biases
        were folded into ``b_O`` holds zeros here. ``docs/definitions.md`` §1.3: the analyses read
        ``v - b_V`` and ``z - b_V`` and count ``b_V W_O`` with ``b_O``.
        """
        attn = self.model.blocks[layer].attn
        bias = getattr(attn, "b_V", None)
        if not isinstance(bias, Tensor):
            return None
        stamp = (bias.data_ptr(), bias._version, bias.device)
        known = self._value_bias_nonzero.get(layer)
        if known is None or known[0] != stamp:
            known = (stamp, bool(bias.detach().any()))
            self._value_bias_nonzero[layer] = known
        if not known[1]:
            return None
        bias = bias.detach()
        n_heads = int(self.model.cfg.n_heads)
        if bias.ndim != 2 or n_heads % bias.shape[0]:
            raise ValueError(
                f"blocks.{layer}.attn.b_V has shape {tuple(bias.shape)}; expected [head_index or kv_head, d_head] "
                f"with {n_heads} heads a multiple of its rows"
            )
        return bias.repeat_interleave(n_heads // bias.shape[0], dim=0) if bias.shape[0] != n_heads else bias

    def _b_O(self, layer: int) -> Float[Tensor, " d_model"]:
        bias = getattr(self.model.blocks[layer].attn, "b_O", None)
        if isinstance(bias, Tensor):
            return bias.detach().float()
        return torch.zeros(int(self.model.cfg.d_model), device=self.device)

    def probe_tokens(self) -> Tokens:
        """A short text of ids (``[1, <= 4]``, no padding id) for the probes."""
        cfg = self.model.cfg
        pad = getattr(getattr(self.model, "tokenizer", None), "pad_token_id", None)
        ids = [i % int(cfg.d_vocab) for i in range(1, 7) if i != pad][: max(1, min(4, int(cfg.n_ctx)))]
        return torch.tensor([ids], device=self.device)

    def edits_reach_output(
        self, layer: int, edits: Sequence[Edit] | None = None, *, tokens: Tokens | None = None
    ) -> bool:
        """Whether ``edits`` that remove every source of every query at ``layer`` take effect: one forward
        on ``tokens`` (default :meth:`probe_tokens`, real tokens only) after which
        ``blocks.{layer}.hook_attn_out`` must equal ``b_O`` (to ``1e-4`` relative). ``edits`` default to
        ``hook_pattern`` set to zero. The backend's warnings about discarded edits are silenced: the probe
        is the test. No hook stays attached.
        """
        model = self.model
        toks = self.probe_tokens() if tokens is None else tokens
        if edits is None:
            edits = [(f"blocks.{layer}.attn.hook_pattern", _zero)]
        seen: dict[str, Tensor] = {}

        def read(x: Tensor, hook: Any) -> None:
            seen["out"] = x.detach().float()

        hooks = [*edits, (f"blocks.{layer}.hook_attn_out", read)]
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", UserWarning)
            with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
                model(toks, **self.forward_kwargs(return_type=None))
        if "out" not in seen:
            return False
        b_O = self._b_O(layer).to(seen["out"].device)
        return float((seen["out"] - b_O).abs().max()) <= 1e-4 * (1 + float(b_O.abs().max()))

    def edits_take_effect(self, layer: int, point: str = "hook_pattern") -> bool:
        """Whether an edit at ``blocks.{layer}.attn.{point}`` changes the model's computation: zeroing
        ``hook_pattern``, ``hook_v`` or ``hook_z`` there must change the logits of :meth:`probe_tokens`
        (beyond ``1e-6`` of their scale; a discarded edit leaves them bit for bit). The output is the test
        because where a backend fires ``hook_attn_out`` differs (a BERT bridge's reads after the residual
        and LayerNorm). Probed once per layer and hook point and cached.

        Raises:
            ValueError: ``point`` is not ``"hook_pattern"``, ``"hook_v"`` or ``"hook_z"``.
        """
        if point not in ("hook_pattern", "hook_v", "hook_z"):
            raise ValueError(f"point must be 'hook_pattern', 'hook_v' or 'hook_z', got {point!r}")
        key = (point, layer)
        if key not in self._other_edits:
            model, toks = self.model, self.probe_tokens()
            kwargs = self.forward_kwargs(return_type="logits")
            outs = []
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore", UserWarning)  # the backend's notes on discarded edits
                for hooks in ([], [(f"blocks.{layer}.attn.{point}", _zero)]):
                    with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
                        outs.append(model(toks, **kwargs).detach().float())
            scale = 1.0 + float(outs[0].abs().max())
            self._other_edits[key] = float((outs[1] - outs[0]).abs().max()) > 1e-6 * scale
        return self._other_edits[key]

    def check_edits(self, layers: Sequence[int], point: str, what: str) -> None:
        """Raise :meth:`ignored_edits_error` at the first of ``layers`` where an edit at ``point`` would not
        change the output (:meth:`edits_take_effect`): an intervention never does nothing silently.

        Args:
            layers: the layers the intervention edits.
            point: ``"hook_pattern"``, ``"hook_v"`` or ``"hook_z"``.
            what: the intervention, for the message (e.g. ``"source masking"``).

        Raises:
            RuntimeError: the backend discards the edit, naming the backend and the hook point.
        """
        for layer in layers:
            if not self.edits_take_effect(int(layer), point):
                raise self.ignored_edits_error(
                    int(layer), (point,), what, probe="zeroing it leaves the logits"
                )

    def pattern_edits_take_effect(self, layer: int, *, tokens: Tokens | None = None) -> bool:
        """Whether an edit at ``blocks.{layer}.attn.hook_pattern`` reaches the output (a zeroed pattern
        leaves ``hook_attn_out = b_O``; :meth:`edits_reach_output`). True for ``HookedTransformer``,
        ``HookedEncoder`` and TransformerLens 4's decoder bridges; false for 3.x's bridges and 4.x's BERT
        bridge. Probed once per layer (on ``tokens`` if given) and cached."""
        if layer not in self._pattern_edits:
            self._pattern_edits[layer] = self.edits_reach_output(layer, tokens=tokens)
        return self._pattern_edits[layer]

    def ignored_edits_error(
        self,
        layer: int,
        hook_points: Sequence[str] = ("hook_pattern",),
        what: str = "this intervention",
        probe: str = "removing every source leaves hook_attn_out",
    ) -> RuntimeError:
        """The error for edits this backend discards, naming the backend and the hook points, e.g.
        ``"... ignores edits to blocks.0.attn.hook_pattern and hook_z (...), so source masking would change
        nothing; ..."``; the caller raises it."""
        points = f"blocks.{layer}.attn.{hook_points[0]}" + "".join(f" and {p}" for p in hook_points[1:])
        instead = (
            "load the model with backend='hooked' (a HookedTransformer or HookedEncoder), or use TransformerLens 4"
            if self.is_bridge and TL_VERSION.split(".")[0] == "3"
            else "mechgeom cannot intervene there on this backend"
        )
        return RuntimeError(
            f"{self.name} ignores edits to {points} ({probe} unchanged), "
            f"so {what} would change nothing; {instead}"
        )


_ADAPTERS: weakref.WeakKeyDictionary[Any, ModelAdapter] = weakref.WeakKeyDictionary()


def adapter(model: Any) -> ModelAdapter:
    """The :class:`ModelAdapter` of ``model``: one per model while it lives (models that cannot be weakly
    referenced or hashed, such as a ``SimpleNamespace``, get a fresh one each call)."""
    try:
        found = _ADAPTERS.get(model)
    except TypeError:
        return ModelAdapter(model)
    if found is None:
        found = ModelAdapter(model)
        _ADAPTERS[model] = found
    return found


def is_bridge(model: Any) -> bool:
    """Whether ``model`` is a TransformerLens ``TransformerBridge`` (the only backend on TL 4.x)."""
    return adapter(model).is_bridge


def is_encoder(model: Any) -> bool:
    """Whether ``model`` is an encoder (BERT-style, bidirectional attention): ``cfg.attention_dir`` or the
    class (``HookedEncoder``).

    >>> from types import SimpleNamespace
    >>> is_encoder(SimpleNamespace(cfg=SimpleNamespace(attention_dir="causal")))
    False
    """
    return adapter(model).is_encoder
