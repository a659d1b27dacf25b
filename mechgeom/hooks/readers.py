"""Readers: the hook collector and the shared tensor maths every analysis imports.

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

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import einops
import torch
from transformer_lens.hook_points import HookPoint

from mechgeom._progress import progress
from mechgeom.hooks.validation import check_attention_mask, is_bidirectional, padding_mask, resolve_layers
from mechgeom.models.adapter import adapter
from mechgeom.typing import WO, Bool, Float, HeadOut, Pattern, Tensor, Tokens, Values, Z

__all__ = [
    "FwdHook",
    "LayerActivations",
    "LayerCollector",
    "current_pass_mask",
    "expand_kv",
    "foreign_hooks_after",
    "future_weight",
    "has_hooks",
    "head_outputs",
    "hook_name",
    "layer_W_O",
    "layer_b_O",
    "modified_mask",
    "modified_pairs",
    "pass_mask",
    "real_positions",
    "run_batches",
    "run_hooks",
]

HookKind = Literal["pattern", "v", "z", "attn_out", "q", "k", "result"]
#: A ``(hook_name, fn)`` pair as accepted by ``run_with_hooks(fwd_hooks=...)``.
FwdHook = tuple[str, Callable[..., Any]]


def hook_name(layer: int, kind: HookKind) -> str:
    """The TransformerLens name of an attention hook of ``layer``."""
    if kind == "attn_out":
        return f"blocks.{layer}.hook_attn_out"
    return f"blocks.{layer}.attn.hook_{kind}"


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


#: Default relative tolerance of :func:`modified_mask` per dtype of ``z`` (others: 1e-2). In half precision the
#: bound is the model's own rounding: with unit roundoff ``u`` (2**-8 in bfloat16, 2**-11 in float16), ``z`` rounded
#: to its dtype is off by at most ``u ‖z‖``, and products of ``alpha v`` rounded before they are summed add at most
#: ``u sum_j alpha ‖v_j‖``; the check itself runs in float32 (its own error is ~1e-7 of the scale). The default is
#: twice the sum, ``2u``: a clean pass is never marked, and an intervention is found once it moves ``z`` by more
#: than ~0.8 % (bfloat16) or ~0.1 % (float16) of the scale, which ablation and patching do by far.
MODIFIED_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def modified_mask(
    pattern: Pattern,
    v: Values,
    z: Z,
    *,
    rtol: float | None = None,
    causal: bool = False,
    block_size: int = 128,
) -> Bool[Tensor, "batch head_index query_pos"]:
    """Where an earlier hook changed ``z``: ``True`` at ``(b, h, i)`` when ``z[i,h] != sum_j alpha[h,i,j] v[j,h]``.

    ``docs/definitions.md`` §2.6, "After an intervention": head ``h`` is *modified* at query ``i`` when
    ``‖z[i,h] − sum_j alpha[h,i,j] v[j,h]‖ > rtol * (sum_j alpha[h,i,j] ‖v[j,h]‖ + ‖z[i,h]‖)``. The scale on the
    right bounds the rounding error of the sum itself, so the test is independent of the units of ``v`` and
    holds for near-zero outputs; ``rtol`` defaults to :data:`MODIFIED_RTOL` for the dtype of ``z`` (1e-4 in
    float32, ``2u`` in half precision, see there). ``v`` is GQA-expanded. The cost is that of one attention
    product per layer: both sums come from one product of ``alpha`` with ``[v, ‖v‖]``, ``block_size``
    queries at a time, in float32 at least (a bfloat16 or float16 pattern is upcast one block at a time, so
    the check adds no rounding of its own to the model's). ``causal=True`` (a decoder's pattern, 0 above the
    diagonal) takes each block against only the keys its queries can see, about half the work; a pattern
    with weight above the diagonal then reads as modified wherever that weight matters.

    >>> p = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])  # [b h q k]
    >>> v = torch.tensor([[[[1.0]], [[3.0]]]])  # [b k h d]
    >>> z = torch.tensor([[[[1.0]], [[2.0]]]])  # = alpha @ v: unmodified
    >>> modified_mask(p, v, z).tolist(), modified_mask(p, v, torch.zeros_like(z)).tolist()
    ([[[False, False]]], [[[True, True]]])
    """
    tol = MODIFIED_RTOL.get(z.dtype, 1e-2) if rtol is None else float(rtol)
    dtype = torch.promote_types(pattern.dtype, torch.float32)  # float32 for half precision, float64 kept
    v_h = einops.rearrange(v.to(dtype), "b k h d -> b h k d")
    v_aug = torch.cat([v_h, v_h.norm(dim=-1, keepdim=True)], dim=-1)  # [b h k d+1]
    B, H, Q, K = pattern.shape
    # [b h q d+1]: sum_j alpha v_j, sum_j alpha ‖v_j‖
    sums = pattern.new_empty((B, H, Q, v_aug.shape[-1]), dtype=dtype)
    step = max(1, int(block_size))
    for q0 in range(0, Q, step):
        q1 = min(q0 + step, Q)
        keys = q1 if causal and Q == K else K
        alpha = pattern[:, :, q0:q1, :keys].to(dtype)  # one block upcast (a view when already dtype)
        torch.matmul(alpha, v_aug[:, :, :keys], out=sums[:, :, q0:q1])
    mixed, scale = sums[..., :-1], sums[..., -1]
    z_h = einops.rearrange(z, "b q h d -> b h q d").to(mixed.dtype)
    return (z_h - mixed).norm(dim=-1) > tol * (scale + z_h.norm(dim=-1))


def modified_pairs(
    modified: Bool[Tensor, "batch layer head_index query_pos"] | None, layers: Sequence[int]
) -> list[tuple[int, int]]:
    """The ``(layer, head)`` pairs marked at some text and query of a result's ``modified`` mask.

    >>> m = torch.zeros(1, 2, 3, 4, dtype=torch.bool)
    >>> m[0, 1, 2, 3] = True
    >>> modified_pairs(m, [5, 7])
    [(7, 2)]
    """
    if modified is None:
        return []
    hit = modified.any(dim=3).any(dim=0)  # [layer head]
    return [(int(layers[li]), int(h)) for li, h in hit.nonzero().tolist()]


def head_outputs(z: Z, W_O: WO) -> HeadOut:
    """Per-head outputs ``o[i,h] = z[i,h] @ W_O[h]`` (bias excluded), ``[batch, pos, head, d_model]``."""
    return einops.einsum(z, W_O, "batch pos head d_head, head d_head d_model -> batch pos head d_model")


# --------------------------------------------------------------------------- collecting


@dataclass
class LayerActivations:
    """One layer's attention activations, as seen by the hooks (``v`` already GQA-expanded).

    ``v`` and ``z`` are read without the value bias (``docs/definitions.md`` §1.3): where the model keeps a
    value bias ``b_V`` in ``hook_v``, the collector subtracts it from ``hook_v`` and from ``hook_z``, so
    ``vt = v @ W_O = x W_V W_O`` whether or not the model was loaded with its value biases folded; ``b_V``
    holds that bias (per query head; ``None`` where the model has none) and :attr:`bias_out` is the
    layer's constant output ``b_O + sum_h b_V[h] W_O[h]``.

    ``modified[b, h, i]`` is ``True`` where ``z`` is not ``sum_j alpha v_j`` (an earlier hook changed it, see
    :func:`modified_mask`); ``None`` means "not checked" (treated as unmodified). ``causal`` is ``False`` for an
    encoder, whose queries see every key; ``key_mask[b, j]`` is then ``False`` at padding (a key no query of
    text ``b`` attends to, in any head), ``None`` when there is none. ``window`` is the width ``W`` of a
    sliding-window layer (its query ``i`` sees the keys ``i - W < j <= i`` only; ``None``: every earlier key).
    """

    layer: int
    pattern: Pattern
    v: Values
    z: Z
    W_O: WO
    b_O: Float[Tensor, " d_model"]
    modified: Bool[Tensor, "batch head_index query_pos"] | None = None
    causal: bool = True
    key_mask: Bool[Tensor, "batch key_pos"] | None = None
    window: int | None = None
    b_V: Float[Tensor, "head_index d_head"] | None = None

    @property
    def bias_out(self) -> Float[Tensor, " d_model"]:
        """What ``hook_attn_out`` adds to ``sum_h o[i,h]``: ``b_O``, plus ``sum_h b_V[h] W_O[h]`` where the
        model keeps a value bias (exact because every pattern row sums to 1)."""
        if self.b_V is None:
            return self.b_O
        W_O = self.W_O
        return self.b_O + einops.einsum(
            self.b_V.to(W_O.dtype), W_O, "head d_head, head d_head d_model -> d_model"
        )

    @property
    def any_modified(self) -> bool:
        return self.modified is not None and bool(self.modified.any())

    def modified_heads(self) -> list[int]:
        """Heads modified at some query of some text."""
        if self.modified is None:
            return []
        return [int(h) for h in self.modified.any(dim=2).any(dim=0).nonzero().flatten().tolist()]


def _sole_hook(hook: HookPoint | None) -> bool:
    """Whether the reader that ``hook`` just called is the only hook there (no other forward hook or pre-hook
    on that hook point, no global module hook) and the model is in eval mode: then nothing else can have
    changed the activation it read, before or after it, and :func:`modified_mask` need not run."""
    if not isinstance(hook, torch.nn.Module) or hook.training:
        return False
    glob = torch.nn.modules.module
    return (
        len(hook._forward_hooks) == 1
        and not hook._forward_pre_hooks
        and not glob._global_forward_hooks
        and not glob._global_forward_pre_hooks
    )


def _user_hooks(hook: HookPoint) -> list[Any]:
    """The functions registered on ``hook`` as forward hooks, in the order they run: the hook TransformerLens
    wraps (the ``hook`` cell of its wrapper's closure), or the raw PyTorch hook where there is no such cell."""
    out = []
    for fn in hook._forward_hooks.values():
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        names = code.co_freevars if code is not None else ()
        inner = cells[names.index("hook")].cell_contents if "hook" in names else fn
        out.append(inner)
    return out


def _is_reader(fn: Any) -> bool:
    """Whether ``fn`` is the hook of a :class:`LayerCollector` (it only reads)."""
    method = getattr(fn, "func", None)
    return getattr(method, "__func__", None) is LayerCollector._store


def foreign_hooks_after(hook: HookPoint | None, reader: LayerCollector, layer: int, kind: str) -> list[Any]:
    """The hooks on ``hook`` that run after ``reader``'s hook for ``(layer, kind)`` and are not mechgeom readers:
    what they return replaces the activation the reader just read, unseen by it. Empty where the hook point
    cannot be read."""
    if not isinstance(hook, torch.nn.Module):
        return []
    fns = _user_hooks(hook)

    def is_mine(fn: Any) -> bool:
        return _is_reader(fn) and fn.func.__self__ is reader and fn.keywords == {"layer": layer, "kind": kind}

    at = next((i for i, fn in enumerate(fns) if is_mine(fn)), None)
    return [] if at is None else [fn for fn in fns[at + 1 :] if not _is_reader(fn)]


def future_weight(pattern: Pattern, block_size: int = 128) -> Bool[Tensor, "batch head_index query_pos"]:
    """Where a causal model's pattern puts weight on a key after its query (an edit made it non-causal): the
    metrics count only keys up to the query, so such a row reads as modified at any length. By blocks of
    queries, so no ``[q, k]`` copy of the pattern is made.

    >>> p = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    >>> future_weight(p).tolist(), future_weight(p.flip(-1)).tolist()
    ([[[False, False]]], [[[True, False]]])
    """
    B, H, Q, K = pattern.shape
    out = torch.zeros(B, H, Q, dtype=torch.bool, device=pattern.device)
    for q0 in range(0, Q, block_size):
        q1 = min(q0 + block_size, Q)
        rows = pattern[:, :, q0:q1]
        hit = torch.triu(rows[..., q0:q1], diagonal=1).ne(0).any(-1)
        if q1 < K:
            hit |= rows[..., q1:].ne(0).any(-1)
        out[:, :, q0:q1] = hit
    return out


def _attended_keys(pattern: Pattern) -> Bool[Tensor, "batch key_pos"] | None:
    """Keys some query attends to in some head, per text: an encoder's padding is the rest (``None``: no padding)."""
    seen = pattern.detach().amax(dim=(1, 2)) > 0  # [b k]
    return None if bool(seen.all()) else seen


#: The mask of real tokens of the forward pass running now (set by :func:`run_hooks` / :func:`pass_mask`).
_PASS_MASK: contextvars.ContextVar[Tensor | None] = contextvars.ContextVar("mechgeom_pass_mask", default=None)


@contextlib.contextmanager
def pass_mask(mask: Bool[Tensor, "batch pos"] | None) -> Iterator[None]:
    """Tell the readers which tokens of the pass run inside this block are real (``True``) and which padding.

    :func:`run_hooks` does it for every pass mechgeom runs. Wrap your own ``model.run_with_hooks(tokens,
    attention_mask=mask, fwd_hooks=collector.fwd_hooks)`` in ``with pass_mask(mask):`` to give the readers the
    same mask; without it a decoder's positions all count as text (:func:`real_positions`).
    """
    token = _PASS_MASK.set(None if mask is None else mask.detach().bool())
    try:
        yield
    finally:
        _PASS_MASK.reset(token)


def current_pass_mask(pattern: Pattern) -> Bool[Tensor, "batch key_pos"] | None:
    """The real tokens of the pass running now, as :func:`pass_mask` (or :func:`run_hooks`) gave them, on the
    pattern's device; ``None`` when the pass came with no mask. What a hook reads to know the pass' padding.

    Raises:
        ValueError: a mask of another shape than ``[batch, key_pos]`` of ``pattern`` (a mask of other tokens).
    """
    mask = _PASS_MASK.get()
    if mask is None:
        return None
    if tuple(mask.shape) != (pattern.shape[0], pattern.shape[-1]):
        raise ValueError(
            f"the pass' attention mask is {tuple(mask.shape)}, but the pattern is [batch={pattern.shape[0]}, "
            f"key_pos={pattern.shape[-1]}]: give the mask of the tokens of this pass"
        )
    return mask.to(pattern.device)


def real_positions(pattern: Pattern, causal: bool) -> Bool[Tensor, "batch key_pos"] | None:
    """The real (non-padding) positions of a pass that came with no mask (:func:`pass_mask`).

    On an encoder, padding is a key that no query attends to in any head (its ``[PAD]`` keys are masked).
    On a decoder nothing is read off the pattern: an intervention that masks sources (sufficiency, a
    knock-out) leaves keys with no weight that are still text, so a decoder's padding is known only from a
    mask: the texts' lengths (:func:`~mechgeom.hooks.validation.to_batch`), ``attention_mask=``, or
    :func:`pass_mask` around a pass of your own. Without one every position is real.

    Returns:
        ``[batch, pos]`` bools, ``None`` when every position is real.
    """
    return None if causal else _attended_keys(pattern)


class LayerCollector:
    """Reads ``hook_pattern``, ``hook_v`` and ``hook_z`` of chosen layers; streams them to ``on_layer``.

    ``fwd_hooks`` is an ordinary list of ``(name, fn)`` pairs: pass it to ``model.run_with_hooks``,
    ``model.hooks(fwd_hooks=...)`` or ``run_with_cache``'s ``model.hooks`` context, beside any other
    hook. The hooks only read (they return ``None``), so they change nothing downstream. When a
    layer's three activations have arrived, ``on_layer(LayerActivations)`` runs and the activations
    are released.

    **Interventions.** A hook that changes ``hook_pattern`` or ``hook_v`` before these readers is seen by
    them, and ``z`` follows from what they read. A hook that changes ``hook_z`` (head removal, patching
    from another run) makes ``z`` differ from ``sum_j alpha v_j``: the reader records it per
    ``(batch, head, query)`` in :attr:`LayerActivations.modified` (see :func:`modified_mask`, tolerance
    ``modified_rtol``), and every analysis marks those heads. Put interventions before the readers in the
    hook list (``[*my_hooks, *collector.fwd_hooks]``); a hook on ``hook_z`` registered after the reader
    is not seen.
    """

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        on_layer: Callable[[LayerActivations], None] | None = None,
        *,
        detach: bool = True,
        modified_rtol: float | None = None,
    ) -> None:
        self.model = model
        self.layers = resolve_layers(model, layers)
        self.on_layer = on_layer
        self.detach = detach
        self.modified_rtol = modified_rtol
        #: The pattern is a decoder's (0 above the diagonal), unless the model is an encoder (bidirectional).
        self.causal = not is_bidirectional(model)
        self._pending: dict[int, dict[str, Tensor]] = {}
        self._alone: dict[int, dict[str, bool]] = {}  # kind -> its hook point had no other hook
        self._warned: set[str] = set()  # hook points where a foreign hook was seen after the reader
        self.captured: dict[int, LayerActivations] = {}

    def _store(self, tensor: Tensor, hook: HookPoint, *, layer: int, kind: str) -> None:
        # tensor: pattern [batch head q k] | v [batch pos kv_head d_head] | z [batch pos head d_head]
        slot = self._pending.setdefault(layer, {})
        slot[kind] = tensor.detach() if self.detach else tensor
        alone = _sole_hook(hook)
        self._alone.setdefault(layer, {})[kind] = alone
        if not alone:
            self._warn_if_read_before_a_change(hook, layer, kind)
        if len(slot) == 3:
            del self._pending[layer]
            v, z = expand_kv(slot["v"], int(self.model.cfg.n_heads)), slot["z"]
            b_V = adapter(self.model).value_bias(layer)
            if b_V is not None:  # docs/definitions.md §1.3: vt = x W_V W_O; b_V W_O goes with b_O
                v, z = v - b_V.to(v.device, v.dtype), z - b_V.to(z.device, z.dtype)
            if all(self._alone.pop(layer).values()):  # no other hook there: z is alpha @ v as computed
                modified = torch.zeros(slot["pattern"].shape[:3], dtype=torch.bool, device=v.device)
            else:
                with torch.no_grad():
                    modified = modified_mask(
                        slot["pattern"], v, z, rtol=self.modified_rtol, causal=self.causal
                    )
                    if self.causal:  # weight after the query: not a source the metrics count
                        modified |= future_weight(slot["pattern"])
            acts = LayerActivations(
                layer=layer,
                pattern=slot["pattern"],
                v=v,
                z=z,
                W_O=layer_W_O(self.model, layer).detach(),
                b_O=layer_b_O(self.model, layer).detach(),
                modified=modified,
                causal=self.causal,
                key_mask=self._key_mask(slot["pattern"]),
                window=adapter(self.model).attention_window(layer) if self.causal else None,
                b_V=b_V,
            )
            if self.on_layer is None:
                self.captured[layer] = acts
            else:
                self.on_layer(acts)

    def _key_mask(self, pattern: Pattern) -> Tensor | None:
        """The pass' real tokens: the mask given for it (:func:`pass_mask`), else read off the pattern."""
        mask = current_pass_mask(pattern)
        if mask is None:
            return real_positions(pattern, self.causal)
        return None if bool(mask.all()) else mask

    def _warn_if_read_before_a_change(self, hook: HookPoint, layer: int, kind: str) -> None:
        """Warn (once per hook point) when a hook that is not a reader runs after this one on the same point.

        The reader cannot see what that hook returns, so an edit it makes there (a ``hook_z`` patch above all)
        would go unmarked. The reader warns rather than moving itself: the order of a user's own hook list is
        the user's, and a hook placed after it may only read.
        """
        name = hook_name(layer, kind)  # type: ignore[arg-type]
        if name in self._warned:
            return
        later = foreign_hooks_after(hook, self, layer, kind)
        if later:
            self._warned.add(name)
            warnings.warn(
                f"a hook runs after mechgeom's reader on {name}; the reader cannot see what it returns, so an edit "
                "it makes there is not in the analysis (nor marked as modified). Put interventions before the "
                "readers: fwd_hooks=[*interventions, *collector.fwd_hooks] (mechgeom's own functions do). If that "
                "hook only reads, this warning does not apply.",
                stacklevel=2,
            )

    @property
    def fwd_hooks(self) -> list[FwdHook]:
        """The ``(hook_name, fn)`` pairs, three per layer."""
        from functools import partial

        hooks: list[FwdHook] = []
        for layer in self.layers:
            for kind in ("v", "pattern", "z"):
                hooks.append((hook_name(layer, kind), partial(self._store, layer=layer, kind=kind)))  # type: ignore[arg-type]
        return hooks

    def feed_cache(self, cache: Any, attention_mask: Bool[Tensor, "batch pos"] | None = None) -> None:
        """Replay an ``ActivationCache`` (or a dict of activations) through the same path as the hooks;
        ``attention_mask`` marks the cached pass' real tokens (default: read off the pattern)."""
        with pass_mask(attention_mask):
            self._feed(cache)

    def _feed(self, cache: Any) -> None:
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
    attention_mask: Bool[Tensor, "batch pos"] | None = None,
) -> Any:
    """One forward pass with ``fwd_hooks``; the hooks are removed afterwards, also if a hook raises.

    ``attention_mask`` (``[batch, pos]``, 1 at real tokens; on an encoder the default is
    :func:`~mechgeom.hooks.validation.padding_mask` of ``tokens``) keeps padded keys out of every query's
    attention, left or right padding alike, and tells the readers which positions are real
    (:func:`pass_mask`). The backend's adapter (:meth:`~mechgeom.models.adapter.ModelAdapter.forward_kwargs`)
    passes it and ``stop_at_layer`` the way the model takes them, and refuses a mask the model would ignore.
    A mask with no padding is not passed, so an unpadded pass is the plain forward.
    """
    if attention_mask is None and is_bidirectional(model):
        attention_mask = padding_mask(model, tokens)
    if attention_mask is not None:
        check_attention_mask(attention_mask, tokens)
        if bool(attention_mask.bool().all()):
            attention_mask = None
    kwargs = adapter(model).forward_kwargs(
        return_type=return_type, stop_at_layer=stop_at_layer, attention_mask=attention_mask
    )
    mask = None if attention_mask is None else attention_mask.to(tokens.device).bool()
    with torch.no_grad(), pass_mask(mask), model.hooks(fwd_hooks=list(fwd_hooks), reset_hooks_end=True):
        return model(tokens, **kwargs)


def run_batches(
    model: Any,
    tokens: Tokens,
    fwd_hooks: Sequence[FwdHook],
    *,
    batch_size: int,
    stop_at_layer: int | None = None,
    desc: str = "batches",
    verbose: bool = False,
    attention_mask: Bool[Tensor, "batch pos"] | None = None,
) -> None:
    """Feed ``tokens`` to the model in batches of ``batch_size`` texts with ``fwd_hooks`` (readers that
    accumulate, e.g. a collector's), a :func:`mechgeom._progress.progress` bar over batches (``desc``);
    every batch goes through :func:`run_hooks` with its rows of ``attention_mask``, so no hook stays
    attached, also on error."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if attention_mask is not None:
        check_attention_mask(attention_mask, tokens)
    starts = range(0, tokens.shape[0], batch_size)
    for start in progress(starts, desc=desc, enabled=verbose, total=len(starts)):
        batch = tokens[start : start + batch_size].to(model.cfg.device)
        mask = None if attention_mask is None else attention_mask[start : start + batch_size].to(batch.device)
        run_hooks(model, batch, fwd_hooks, stop_at_layer=stop_at_layer, attention_mask=mask)


def has_hooks(model: Any) -> bool:
    """Whether any forward hook is still attached to one of the model's hook points."""
    return any(len(hp.fwd_hooks) > 0 for hp in model.hook_dict.values())
