"""Which torch devices this machine has, and the one-line error for one it lacks (:func:`check_device`).

``load_model(device=...)`` checks its device here before reading any weights, so ``"cuda"`` on a machine
without CUDA, ``"cuda:3"`` on a machine with one GPU, ``"mps"`` off a Mac or a misspelt device string gives
one ``ValueError`` naming the device and the devices there are, instead of torch's bare ``AssertionError``.
"""

from __future__ import annotations

import torch

__all__ = ["available_devices", "check_device"]


def available_devices() -> list[str]:
    """The devices a model can be put on here: ``"cpu"``, then ``"cuda:<i>"`` of each visible GPU,
    ``"mps"`` on Apple silicon, ``"xpu:<i>"`` of each Intel GPU.

    Returns:
        The device strings, ``"cpu"`` first.
    """
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        found += [f"xpu:{i}" for i in range(xpu.device_count())]
    return found


def _why_missing(dev: torch.device) -> str | None:
    """Why ``dev`` cannot be used here, or ``None`` when it can."""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = (
                "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            )
            return f"torch {torch.__version__} ({build}) sees no CUDA device"
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            return f"there {'is' if count == 1 else 'are'} {count} CUDA device{'s' * (count != 1)}"
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return "MPS (Apple silicon) is not available"
    elif dev.type == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            return "no Intel XPU is available"
        if dev.index is not None and dev.index >= xpu.device_count():
            return f"there are {xpu.device_count()} XPU devices"
    elif dev.type != "cpu":
        try:  # any other backend: try to place a tensor there
            torch.empty(0, device=dev)
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unusable'}"
    return None


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, once it is known to be usable on this machine.

    Args:
        device: a device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``) or a ``torch.device``.

    Returns:
        The ``torch.device``.

    Raises:
        ValueError: one line naming ``device``, why it cannot be used and the devices there are
            (:func:`available_devices`).
    """
    here = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"device={device!r} is not a torch device ({first}); available here: {here}"
        ) from None
    why = _why_missing(dev)
    if why is not None:
        raise ValueError(f"device={device!r} is not available: {why}; available here: {here}")
    return dev
