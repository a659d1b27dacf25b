"""A memory budget for an analysis' outputs: estimate them before anything is allocated, refuse what would not fit.

An analysis that keeps ``[batch, layer, head, query, key]`` tensors grows with the square of the text length:
SmolLM2-135M at 2,048 tokens, every layer and the default contribution metrics, needs 33.7 GB of float32
outputs (:func:`contribution_output_bytes`). Rather than let the allocator fail half-way through a forward
pass (or the machine swap), an entry point estimates its outputs first and raises :class:`MemoryBudgetError`
when the estimate is above the budget, naming the estimate and the ways out.

**The budget.** ``memory_budget=`` in bytes where an entry point takes it (``math.inf``: no check); else
:data:`MEMORY_BUDGET` (bytes; a module-level default a session may set); else :data:`DEFAULT_FRACTION` (50 %)
of the free memory of the device that will hold the outputs (:func:`free_memory`: the available memory on
CPU, ``torch.cuda.mem_get_info`` on CUDA), read when the call is made.

>>> contribution_output_bytes(batch=1, layers=30, heads=9, queries=2048, keys=2048, intra=7, inter=4) / 1e9
33.72...
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mechgeom.hooks import hook_name

__all__ = [
    "DEFAULT_FRACTION",
    "MEMORY_BUDGET",
    "MemoryBudgetError",
    "budget_bytes",
    "check_memory",
    "contribution_budget",
    "contribution_output_bytes",
    "format_bytes",
    "free_memory",
    "model_device",
]

#: The share of the free memory of the outputs' device an analysis may fill when no budget is given.
DEFAULT_FRACTION = 0.5
#: A session-wide budget in bytes (``math.inf``: no check), used where a call gives no ``memory_budget=``;
#: ``None``: :data:`DEFAULT_FRACTION` of the free memory at the time of the call.
MEMORY_BUDGET: float | None = None


class MemoryBudgetError(MemoryError):
    """An analysis' outputs, estimated before anything is allocated, are above the memory budget."""


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units (``33.7 GB``), as the budget's messages give them.

    >>> format_bytes(33_722_204_160), format_bytes(512)
    ('33.7 GB', '512 B')
    """
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def free_memory(device: str | torch.device) -> int:
    """Bytes free on ``device`` now: ``torch.cuda.mem_get_info`` on CUDA; on CPU (and any other device) the
    memory available to new allocations without swapping (``psutil.virtual_memory().available``, else
    ``MemAvailable`` of ``/proc/meminfo``, else the free physical pages)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (
        ImportError
    ):  # psutil is not a dependency of mechgeom; it is nearly always there (accelerate, ipython)
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def budget_bytes(device: str | torch.device, memory_budget: float | None = None) -> float:
    """The budget in bytes: ``memory_budget``, else :data:`MEMORY_BUDGET`, else :data:`DEFAULT_FRACTION` of
    :func:`free_memory` of ``device``.

    Raises:
        ValueError: A budget that is not a positive number of bytes.
    """
    budget = memory_budget if memory_budget is not None else MEMORY_BUDGET
    if budget is None:
        return DEFAULT_FRACTION * free_memory(device)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(
            f"memory_budget must be a positive number of bytes (math.inf: no check), or None for "
            f"{DEFAULT_FRACTION:.0%} of the free memory; got {budget!r}"
        )
    return float(budget)


def contribution_output_bytes(
    *,
    batch: int,
    layers: int,
    heads: int,
    queries: int,
    keys: int,
    intra: int,
    inter: int,
    itemsize: int = 4,
    top_k: int | None = None,
) -> int:
    """Bytes of the outputs of a contribution call (pure arithmetic, nothing is run).

    ``intra`` metrics of ``[batch, layer, head, query, key]`` and ``inter`` of ``[batch, layer, query, key]``,
    ``itemsize`` bytes each (4 for float32, the outputs of a float32 or half-precision model), plus the
    ``modified`` mask (1 byte) and ``modified_share`` (``itemsize``) of ``[batch, layer, head, query]``.
    ``queries`` is the number of query rows kept per text (every position by default); ``layers=1`` is a
    streaming collector's one layer of buffers.

    Args:
        batch: Texts.
        layers: Layers kept (1 for a streaming ``on_layer`` collector).
        heads: Heads per layer.
        queries: Query rows per text.
        keys: Key positions per text (the padded length).
        intra: Intra-head metrics kept.
        inter: Inter-head metrics kept.
        itemsize: Bytes per value.
        top_k: Sources kept per query row, head and metric (``top_k=``): ``min(top_k, keys)`` values and their
            key positions (8 bytes each) instead of ``keys`` values. ``None``: every key.

    Returns:
        The estimate in bytes.

    >>> contribution_output_bytes(batch=2, layers=1, heads=1, queries=3, keys=3, intra=1, inter=1)  # 2*9*4*2 + 2*3*5
    174
    """
    rows = batch * layers * queries
    per_row = keys * itemsize if top_k is None else min(int(top_k), keys) * (itemsize + 8)
    return rows * per_row * (heads * intra + inter) + rows * heads * (1 + itemsize)


def check_memory(
    estimate: int,
    *,
    device: str | torch.device,
    memory_budget: float | None,
    what: str,
    ways_out: list[str],
) -> None:
    """Raise :class:`MemoryBudgetError` when ``estimate`` bytes are above the budget (:func:`budget_bytes`).

    Args:
        estimate: Bytes the call would allocate for its outputs.
        device: Where they would be allocated (the budget's default is a share of its free memory).
        memory_budget: The call's ``memory_budget=`` (``None``: the module's default).
        what: The call, for the message (e.g. ``"contribution_weights at batch 1 x 2048 tokens, 30 layers"``).
        ways_out: How to need less, one item each, for the message.

    Raises:
        MemoryBudgetError: ``estimate`` above the budget; the message gives both, the ways out and how to raise
            the budget.
    """
    budget = budget_bytes(device, memory_budget)
    if estimate <= budget:
        return
    source = (
        "memory_budget="
        if memory_budget is not None
        else "mechgeom.analyses.budget.MEMORY_BUDGET"
        if MEMORY_BUDGET is not None
        else f"{DEFAULT_FRACTION:.0%} of the {format_bytes(free_memory(device))} free on {torch.device(device)}"
    )
    lines = "\n".join(f"  - {w}" for w in ways_out)
    raise MemoryBudgetError(
        f"{what} would allocate {format_bytes(estimate)} ({estimate} bytes) of outputs, above the memory budget of "
        f"{format_bytes(budget)} ({source}). Ways out:\n{lines}\n"
        f"  - or raise the budget: memory_budget=<bytes> (math.inf: no check), or set "
        f"mechgeom.analyses.budget.MEMORY_BUDGET"
    )


def model_device(model: Any) -> torch.device:
    """The device of ``model``'s parameters (``cfg.device``, else CPU, for a model without any)."""
    first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    if first is not None:
        return first.device
    return torch.device(getattr(getattr(model, "cfg", None), "device", None) or "cpu")


def contribution_budget(
    collector: Any,
    shape: tuple[int, int] | torch.Size | None = None,
    *,
    cache: Any = None,
    memory_budget: float | None,
    queries: int | None = None,
) -> None:
    """Check a :class:`~mechgeom.analyses.contribution.weights.ContributionCollector`'s outputs for texts of
    ``shape = (batch, pos)`` (or those of ``cache``) against the budget, before the pass (:func:`check_memory`).

    A collector that keeps its result holds every layer, on its ``store_device``; a streaming one (``on_layer``)
    holds one layer's buffers, on the model's device. ``queries``: the query rows kept per text (default
    ``pos``). A cache without the collector's first layer is not checked (reading it fails with its own
    message).

    Raises:
        MemoryBudgetError: Above the budget, with the estimate and the ways out.
    """
    if shape is None:
        try:
            pattern = cache[hook_name(collector.layers[0], "pattern")]  # [batch head q k]
        except (KeyError, TypeError):
            return
        shape = (pattern.shape[0], pattern.shape[-1])
    batch, pos = int(shape[0]), int(shape[1])
    streaming = collector.user_on_layer is not None
    dtype = collector.out_dtype or torch.promote_types(
        getattr(getattr(collector.model, "cfg", None), "dtype", None) or torch.float32, torch.float32
    )
    layers = 1 if streaming else len(collector.layers)
    estimate = contribution_output_bytes(
        batch=batch,
        layers=layers,
        heads=int(collector.model.cfg.n_heads),
        queries=pos if queries is None else queries,
        keys=pos,
        intra=len(collector.intra_metrics),
        inter=len(collector.inter_metrics),
        itemsize=dtype.itemsize,
        top_k=collector.top_k,
    )
    device = model_device(collector.model) if streaming else collector.store_device
    what = (
        f"contributions of {batch} text(s) x {pos} positions"
        f"{'' if collector.top_k is None else f' (top {collector.top_k} sources)'}, {layers} layer(s)"
        f"{' (one at a time, streamed)' if streaming else ''}, {collector.model.cfg.n_heads} heads, "
        f"{len(collector.intra_metrics)} intra-head and {len(collector.inter_metrics)} inter-head metric(s)"
    )
    ways = [
        "queries=[-1] (or a few positions): O(k) per kept query instead of O(q k)",
        "top_k=16: the 16 largest sources by |value| per query, head and metric, as values and key positions",
        f"fewer metrics (intra=['contribution'], inter=[]) or layers (layers=[...]); kept now: "
        f"intra={list(collector.intra_metrics)}, inter={list(collector.inter_metrics)}",
        "stream: ContributionCollector(model, on_layer=callback) needs one layer's worth "
        "(contribution_overview streams the summary statistics)",
        "out_dtype=torch.bfloat16 halves float32 outputs",
    ]
    check_memory(estimate, device=device, memory_budget=memory_budget, what=what, ways_out=ways)
