"""The contract every analysis follows: a :class:`Collector` that reads activations through hooks, and the
:class:`Result` it builds. The wiring between them is written here once.

**Collector** (the extension point; ``docs/extending.md`` adds an analysis on it). A collector reads
``blocks.{l}.attn.hook_pattern``, ``hook_v`` and ``hook_z`` of its :attr:`~Collector.layers` through one
:class:`~mechgeom.hooks.LayerCollector` (its :attr:`~Collector.reader`), which hands each layer's activations to
:meth:`Collector.on_layer` as soon as that layer's ``hook_z`` has fired, GQA-expanded and with the heads that an
earlier hook changed marked (:attr:`~mechgeom.hooks.LayerActivations.modified`). A subclass implements two
methods:

- :meth:`~Collector.on_layer` does the analysis' maths on one layer and keeps what it needs (sums over
  batches, per-text rows), never the activations themselves;
- :meth:`~Collector.build` turns what was kept into a :class:`Result`.

The base gives every collector the rest: validated layers, ``fwd_hooks`` for ``model.run_with_hooks`` /
``model.hooks(...)`` / ``run_with_cache``, :meth:`~Collector.feed_cache` for an ``ActivationCache`` (checked
before it is read), :meth:`~Collector.result` with the one "nothing was collected" error, and the model's
name. Collectors of one model share one reader in :func:`collect`, so a forward pass reads, expands and checks
each layer once however many analyses listen.

**Result.** Tensors as attributes, :meth:`Result.to_frame` (a tidy table of every text by default, with integer
``layer`` and ``head``) and :meth:`Result.summary` (the headline numbers; no required argument).

**Entry points.** Every analysis has one function of the shape
``analysis(model, tokens_or_text, *, layers=None, cache=None, extra_hooks=(), verbose=False, ...)``, written
with :func:`run_collector`: on text or token ids it runs the model (``extra_hooks``, the user's interventions,
first); with ``cache=`` it reads an ``ActivationCache`` the user already has instead of running anything. The
options of that pass are declared once, as :class:`PassOptions`: an entry point declares its own options
(``layers`` among them) and takes ``**run: Unpack[PassOptions]``, and :func:`entry_point` fills their defaults,
rejects an unknown keyword and shows every option in its signature and docstring.
"""

from __future__ import annotations

import abc
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, ParamSpec, TypedDict, TypeVar, Unpack, cast

import pandas as pd

from mechgeom.hooks import (
    FwdHook,
    LayerActivations,
    LayerCollector,
    TokensOrText,
    hook_name,
    run_batches,
    to_batch,
)
from mechgeom.typing import Tensor, Tokens

__all__ = [
    "PASS_DEFAULTS",
    "Collector",
    "PassOptions",
    "Result",
    "check_cache",
    "collect",
    "entry_point",
    "model_name",
    "nothing_collected",
    "run_collector",
]


def model_name(model: Any) -> str:
    """The model's ``cfg.model_name`` ("" when it has none), as results record it."""
    return str(getattr(getattr(model, "cfg", None), "model_name", "") or "")


def nothing_collected(layers: Sequence[int]) -> RuntimeError:
    """The one error of a result asked for before its collector saw the activations of ``layers``."""
    return RuntimeError(
        f"no activations were collected for layer(s) {list(layers)}: run the model with the collector's "
        "fwd_hooks first (model.run_with_hooks(tokens, fwd_hooks=collector.fwd_hooks), or inside "
        "model.hooks(...)), call collector.feed_cache(cache), or use mechgeom.collect"
    )


def check_cache(cache: Any, layers: Sequence[int]) -> None:
    """Check that ``cache`` holds ``hook_pattern``, ``hook_v`` and ``hook_z`` of ``layers`` with a batch axis.

    Raises:
        KeyError: a needed activation is missing; the message names it and the ``names_filter`` that keeps it.
        ValueError: the cache was made with ``remove_batch_dim=True`` (a ``[head, q, k]`` pattern), which the
            analyses cannot read as ``[batch, head, q, k]``.
    """
    for layer in layers:
        for kind, ndim in (("pattern", 4), ("v", 4), ("z", 4)):
            name = hook_name(layer, kind)  # type: ignore[arg-type]
            try:
                tensor = cache[name]
            except KeyError:
                raise KeyError(
                    f"the cache has no {name!r}: run run_with_cache with a names_filter that keeps "
                    "hook_pattern, hook_v and hook_z of the layers you analyse, e.g. "
                    "names_filter=lambda n: n.endswith(('hook_pattern', 'hook_v', 'hook_z'))"
                ) from None
            if getattr(tensor, "ndim", ndim) == ndim - 1:
                raise ValueError(
                    f"{name} in the cache is {tuple(tensor.shape)}, without a batch axis: the cache was made "
                    "with remove_batch_dim=True. Run run_with_cache without it (mechgeom reads [batch, ...] "
                    "activations), or add the axis back with tensor[None]"
                )


class PassOptions(TypedDict, total=False):
    """The options of the pass every entry point runs, declared once (see :data:`PASS_DEFAULTS`,
    :func:`entry_point`); :func:`run_collector` takes them as they are."""

    cache: Any
    extra_hooks: Sequence[FwdHook]
    verbose: bool
    attention_mask: Tensor | None


#: The default of every :class:`PassOptions` option.
PASS_DEFAULTS: PassOptions = {"cache": None, "extra_hooks": (), "verbose": False, "attention_mask": None}

#: What every :class:`PassOptions` option means, written once; :func:`entry_point` adds it to the Args of
#: every entry point that does not say more about the option itself.
_PASS_DOCS = {
    "cache": "an ``ActivationCache`` (or dict) holding ``hook_pattern``, ``hook_v`` and ``hook_z`` of the "
    "analysed layers: they are read from it and nothing is run (a cache taken under a ``hook_z`` patch is "
    "marked like a live pass). ``tokens_or_text`` are then the cached texts, optional: without them a result "
    "has no token strings.",
    "extra_hooks": "``(hook_name, fn)`` pairs (interventions, e.g. a patching hook) run in the same passes, "
    "before mechgeom's readers on the same hook point; they need a forward pass, so they cannot be combined "
    "with ``cache``.",
    "verbose": "a progress bar over the batches of texts.",
    "attention_mask": "``[batch, pos]``, 1 at real tokens, 0 at padding (left or right). The default is the "
    "padding of a list of texts (the tokenizer's ``padding_side``) and an encoder's ``[PAD]`` ids "
    "(:func:`~mechgeom.hooks.to_batch`); padding is then never a query, a source or a sink, so each text's "
    "numbers are those of the text run alone, at positions inside it. With ``cache`` it marks the cached "
    "pass' padding (derived from ``tokens_or_text`` the same way when they are given).",
}

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _with_pass_docs(doc: str | None, documented: Sequence[str]) -> str:
    """``doc`` (cleaned) with the :class:`PassOptions` it does not document added at the end of its Args."""
    blocks = inspect.cleandoc(doc or "").split("\n\n")
    at = next((i for i, b in enumerate(blocks) if b.startswith("Args:")), None)
    if at is None:
        blocks.append("Args:")
        at = len(blocks) - 1
    for name, text in _PASS_DOCS.items():
        if name not in documented:
            wrapped = textwrap.fill(text, 112, initial_indent=f"    {name}: ", subsequent_indent=" " * 8)
            blocks[at] += "\n" + wrapped
    return "\n\n".join(blocks)


PassOptions.__doc__ = _with_pass_docs(PassOptions.__doc__, ())


def entry_point(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Make ``fn``, declared ``def fn(model, tokens_or_text, *, <its own options>, **run:
    Unpack[PassOptions])``, an entry point: ``run`` holds every :class:`PassOptions` option (the defaults of
    :data:`PASS_DEFAULTS` filled in), an unknown keyword raises ``TypeError`` naming the valid ones, and
    ``inspect.signature`` / ``help`` show every option as a keyword-only parameter with its default, type and
    documentation (``fn``'s own Args may say more about one; the others come from :class:`PassOptions`). A
    ``keyword_only`` deprecation shim (:mod:`mechgeom._deprecation`) goes outside it.

    Args:
        fn: the entry point, its last parameter ``**run``.

    Returns:
        ``fn`` with the options filled in and checked, the same to type checkers.

    Raises:
        TypeError: ``fn`` takes no ``**run``.

    >>> @entry_point
    ... def f(model, tokens_or_text, *, k=1, **run):
    ...     '''Args:
    ...         k: a number.'''
    ...     return k, run["cache"], run["verbose"]
    >>> f(None, "a", verbose=True)
    (1, None, True)
    >>> print(inspect.signature(f))
    (model, tokens_or_text, *, k=1, cache: 'Any' = None, extra_hooks: 'Sequence[FwdHook]' = (), verbose: 'bool' = False, attention_mask: 'Tensor | None' = None)
    >>> f(None, "a", verbos=True)
    Traceback (most recent call last):
    TypeError: f() got an unexpected keyword argument 'verbos'; its options are k, cache, extra_hooks, verbose, attention_mask
    """
    sig = inspect.signature(fn)
    *own, run = sig.parameters.values()
    if run.kind is not run.VAR_KEYWORD or run.name != "run":
        raise TypeError(f"{fn.__name__} must take the pass options as **run: Unpack[PassOptions]")
    annotations = {k: getattr(a, "__forward_arg__", a) for k, a in PassOptions.__annotations__.items()}
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotations[name])
        for name, default in PASS_DEFAULTS.items()
    ]
    options = [p.name for p in own if p.kind is p.KEYWORD_ONLY] + list(PASS_DEFAULTS)
    keywords = {p.name for p in own if p.kind is not p.POSITIONAL_ONLY} | set(PASS_DEFAULTS)

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> _R:
        unknown = [k for k in kwargs if k not in keywords]
        if unknown:
            raise TypeError(
                f"{fn.__name__}() got an unexpected keyword argument {unknown[0]!r}; its options are "
                + ", ".join(options)
            )
        return fn(*args, **{**PASS_DEFAULTS, **kwargs})  # type: ignore[arg-type]

    inner.__signature__ = sig.replace(parameters=[*own, *shared])  # type: ignore[attr-defined]
    documented = [n for n in PASS_DEFAULTS if f"\n    {n}: " in "\n" + inspect.cleandoc(fn.__doc__ or "")]
    inner.__doc__ = _with_pass_docs(fn.__doc__, documented)
    return cast(Callable[_P, _R], inner)


class Result(abc.ABC):
    """What every analysis returns: its tensors as attributes, a tidy table and its headline numbers."""

    @abc.abstractmethod
    def to_frame(self) -> pd.DataFrame:
        """A tidy table (one row per observation; integer ``layer`` and ``head`` columns where they apply),
        every analysed text by default; subclasses may add keyword-only filters."""

    @abc.abstractmethod
    def summary(self) -> dict[str, Any]:
        """The headline numbers, as plain Python values; subclasses may add keyword-only options."""


class Collector(abc.ABC):
    """The base of every analysis' hook collector (see the module docstring for the contract).

    Args:
        model: a TransformerLens ``HookedTransformer``, ``HookedEncoder`` or ``TransformerBridge``.
        layers: the layers to read, an int or a sequence of ints; ``None`` means every layer.
        modified_rtol: tolerance of the check that an earlier hook changed ``z``
            (:func:`~mechgeom.hooks.modified_mask`); ``None`` is the dtype's default.

    Subclasses call ``super().__init__(model, layers, ...)`` first and implement :meth:`on_layer` and
    :meth:`build`; ``supports_encoders`` says whether the analysis is defined on a bidirectional model.
    """

    #: Whether the analysis is defined on an encoder (bidirectional attention, padding).
    supports_encoders: ClassVar[bool] = False

    def __init__(
        self, model: Any, layers: int | Sequence[int] | None = None, *, modified_rtol: float | None = None
    ) -> None:
        self.model = model
        #: The one reader of this collector's hooks (shared with other collectors in :func:`collect`).
        self.reader = LayerCollector(model, layers, self.receive, modified_rtol=modified_rtol)
        #: The model layers this collector reads, in order.
        self.layers: list[int] = self.reader.layers
        self._seen: set[int] = set()

    @property
    def fwd_hooks(self) -> list[FwdHook]:
        """The ``(hook_name, fn)`` pairs to attach, three per layer; they only read."""
        return self.reader.fwd_hooks

    @property
    def causal(self) -> bool:
        """``False`` on an encoder, whose queries see every key."""
        return self.reader.causal

    @property
    def model_name(self) -> str:
        return model_name(self.model)

    def receive(self, acts: LayerActivations) -> None:
        """Take one layer's activations: :meth:`on_layer`, then note the layer as seen. The reader calls it; a
        collector that composes another (as head statistics carry the taxonomy) passes the same activations
        on by calling the other's ``receive``, so both read one set of hooks."""
        self.on_layer(acts)
        self._seen.add(acts.layer)

    @abc.abstractmethod
    def on_layer(self, acts: LayerActivations) -> None:
        """The analysis' maths on one layer's activations; keep results, not activations."""

    @abc.abstractmethod
    def build(self, tokens: Tokens | None) -> Result:
        """The result of everything received so far; ``tokens`` are the analysed ids (``None`` from a cache
        given without them), on the CPU."""

    def result(self, tokens: Tokens | None = None) -> Result:
        """The result of every pass so far (or of :meth:`feed_cache`); ``tokens`` (optional) are the analysed
        ids, whose strings come from the model's tokenizer.

        Raises:
            RuntimeError: a layer of :attr:`layers` was never received.
        """
        missing = [layer for layer in self.layers if layer not in self._seen]
        if missing:
            raise nothing_collected(missing)
        return self.build(None if tokens is None else tokens.detach().cpu())

    def feed_cache(self, cache: Any, attention_mask: Tensor | None = None) -> None:
        """Read an ``ActivationCache`` (or a dict of activations) through the same path as the hooks.

        A cache taken under a ``hook_z`` patch is marked like a live pass. ``attention_mask`` (``[batch,
        pos]``, 1 at real tokens) marks the cached pass' padding; a decoder's positions are all real without
        it. Raises as :func:`check_cache`.
        """
        check_cache(cache, self.layers)
        self.reader.feed_cache(cache, attention_mask)


def _shared_reader(readers: Sequence[LayerCollector]) -> LayerCollector:
    """One reader over the union of layers that hands each layer's activations (GQA expansion and the
    modified-``z`` check done once) to every reader's ``on_layer`` that wants that layer, in order."""

    def on_layer(acts: LayerActivations) -> None:
        for r in readers:
            if acts.layer in r.layers and r.on_layer is not None:
                r.on_layer(acts)

    first = readers[0]
    layers = sorted({la for r in readers for la in r.layers})
    return LayerCollector(
        first.model, layers, on_layer, detach=first.detach, modified_rtol=first.modified_rtol
    )


def _as_collectors(collectors: Collector | Sequence[Collector]) -> tuple[list[Collector], bool]:
    many = not isinstance(collectors, Collector)
    if many and (isinstance(collectors, str | bytes) or not isinstance(collectors, Sequence)):
        raise TypeError(f"expected a collector or a sequence of them, got {type(collectors).__name__}")
    cols: list[Any] = list(collectors) if many else [collectors]  # type: ignore[arg-type]
    if not cols:
        raise ValueError("no collectors given: pass a collector or a non-empty sequence of them")
    for i, c in enumerate(cols):
        if not isinstance(c, Collector):
            raise TypeError(
                f"collectors[{i}] ({type(c).__name__}) is not a collector: mechgeom.analyses.base.Collector "
                "is the base of every analysis' collector (see docs/extending.md)"
            )
    if len({id(c) for c in cols}) < len(cols):
        raise ValueError("the same collector is given twice: it would read every layer twice")
    return cols, many


def collect(
    model: Any,
    tokens: TokensOrText,
    collectors: Collector | Sequence[Collector],
    *,
    batch_size: int = 8,
    extra_hooks: Sequence[FwdHook] = (),
    desc: str = "batches",
    verbose: bool = False,
    attention_mask: Tensor | None = None,
) -> Any:
    """Feed one collector or several from ONE forward pass per batch of ``batch_size`` texts.

    ``extra_hooks`` (interventions) come first, then the readers. The pass stops after the last layer any
    collector reads. Collectors of one model (and one ``modified_rtol``) share one reader: GQA expansion and
    the modified-``z`` check run once per layer, not once per collector, and each gets the same
    :class:`~mechgeom.hooks.LayerActivations`. No hook stays attached, also when a collector raises.

    Args:
        model: the model every collector reads.
        tokens: text, texts or token ids (checked by :func:`~mechgeom.hooks.to_tokens`).
        collectors: a :class:`Collector` or a sequence of them.
        batch_size: texts per forward pass.
        extra_hooks: ``(hook_name, fn)`` pairs run in the same passes, before the readers.
        desc: the progress bar's label; ``verbose`` shows it.
        attention_mask: ``[batch, pos]``, 1 at real tokens. The default is the padding of a list of texts
            (left or right, the model's padding side) and an encoder's ``[PAD]`` ids
            (:func:`~mechgeom.hooks.to_batch`); pads are then never sources, queries, targets or sinks.

    Returns:
        The collector's result, or a list of results in the order of ``collectors``.

    Raises:
        ValueError: an empty list, a collector given twice, or ``batch_size < 1``.
        TypeError: something that is not a :class:`Collector`.

    >>> import torch
    >>> from transformer_lens.config import TransformerBridgeConfig
    >>> from transformer_lens.model_bridge import TransformerBridge
    >>> from mechgeom import SinkCollector, TaxonomyCollector
    >>> cfg = TransformerBridgeConfig(n_layers=2, d_model=8, n_ctx=8, d_head=4, n_heads=2,
    ...                               attn_only=True, d_vocab=10, seed=0)
    >>> model = TransformerBridge.boot_native(cfg)  # works on TransformerLens 3.x and 4.x
    >>> tokens = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1], [5, 6, 7, 8]])
    >>> sinks, labels = collect(model, tokens, [SinkCollector(model), TaxonomyCollector(model)], batch_size=2)
    >>> tuple(sinks.sink_rate.shape), len(labels.to_frame())  # [text, layer, head], one row per head
    ((3, 2, 2), 4)
    """
    cols, many = _as_collectors(collectors)
    encoders = all(c.supports_encoders for c in cols)  # an encoder needs every one to
    tokens, mask = to_batch(
        model, tokens, attention_mask=attention_mask, what="collect with these collectors", encoders=encoders
    )
    stop = 1 + max(max(c.layers) for c in cols)
    groups: dict[tuple[int, float | None, bool], list[LayerCollector]] = {}
    for c in cols:
        r = c.reader
        groups.setdefault((id(r.model), r.modified_rtol, r.detach), []).append(r)
    hooks = list(extra_hooks)
    for readers in groups.values():
        hooks += (readers[0] if len(readers) == 1 else _shared_reader(readers)).fwd_hooks
    run_batches(
        model,
        tokens,
        hooks,
        batch_size=batch_size,
        stop_at_layer=stop,
        desc=desc,
        verbose=verbose,
        attention_mask=mask,
    )
    results = [c.result(tokens) for c in cols]
    return results if many else results[0]


@entry_point
def run_collector(
    model: Any,
    tokens_or_text: TokensOrText | None,
    collector: Collector,
    *,
    batch_size: int = 8,
    desc: str = "batches",
    min_pos: int = 1,
    what: str = "this analysis",
    **run: Unpack[PassOptions],
) -> Any:
    """The body of every entry point: run ``collector`` on ``tokens_or_text``, or read ``cache``.

    Args:
        model: the model ``collector`` reads.
        tokens_or_text: text, texts or token ids; with ``cache`` they are the cached texts (optional: without
            them a result has no token strings).
        collector: a fresh :class:`Collector`.
        batch_size: texts per forward pass.
        desc: the label of ``verbose``'s progress bar.
        min_pos: the fewest positions per text the analysis needs; ``what`` names it in the error.

    Returns:
        The collector's :class:`Result`.
    """
    cache, extra_hooks, attention_mask = run["cache"], run["extra_hooks"], run["attention_mask"]
    encoders = collector.supports_encoders
    if cache is not None:
        if extra_hooks:
            raise ValueError(
                "extra_hooks act during a forward pass, but cache= reads activations already computed: run "
                "the interventions when you make the cache (model.run_with_cache(..., ) inside "
                "model.hooks(fwd_hooks=...)), or pass text or tokens instead of cache"
            )
        tokens, mask = None, attention_mask
        if tokens_or_text is not None:
            tokens, mask = to_batch(
                model,
                tokens_or_text,
                attention_mask=attention_mask,
                min_pos=min_pos,
                what=what,
                encoders=encoders,
                align=False,
            )
        collector.feed_cache(cache, mask)
        return collector.result(tokens)
    if tokens_or_text is None:
        raise ValueError("give text or token ids to analyse, or cache= with the activations of a pass")
    tokens, mask = to_batch(
        model, tokens_or_text, attention_mask=attention_mask, min_pos=min_pos, what=what, encoders=encoders
    )
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return collect(
        model,
        tokens,
        collector,
        batch_size=batch_size,
        extra_hooks=extra_hooks,
        desc=desc,
        verbose=run["verbose"],
        attention_mask=mask,
    )
