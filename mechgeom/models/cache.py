"""The model cache's shared pieces (private): where processed weights live, file hashes, quiet loading,
unreadable-cache handling, config round trips and the cached weights' file; used by
:mod:`mechgeom.models.decoders` and :mod:`mechgeom.models.encoders`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mechgeom._io import atomic_write

try:  # TransformerLens 3.x; 4.0 removed the hooked classes (the bridge is the only backend there)
    from transformer_lens import HookedTransformer, HookedTransformerConfig
except ImportError:
    HookedTransformer = None  # type: ignore[assignment,misc]
    HookedTransformerConfig = None  # type: ignore[assignment,misc]

__all__ = [
    "HookedTransformer",
    "HookedTransformerConfig",
    "cache_dir",
    "cfg_from_json",
    "cfg_to_json",
    "load_weights",
    "quiet",
    "read_cache",
    "save_weights",
    "sha256_file",
]


def cache_dir() -> Path:
    """Where processed state dicts live: ``$MECHGEOM_CACHE`` or the user cache dir."""
    env = os.environ.get("MECHGEOM_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mechgeom"))


def sha256_file(path: Path) -> str:
    """The file's sha256 (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def quiet(verbose: bool = False) -> Iterator[None]:
    """Silence transformers' progress bars and TransformerLens' deprecation notices (unless verbose)."""
    import functools

    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.logging.is_progress_bar_enabled()
    bar = gguf_utils.tqdm
    if not verbose:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        gguf_utils.tqdm = functools.partial(bar, disable=True)  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            if not verbose:
                warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
        gguf_utils.tqdm = bar


def read_cache(load: Any, what: str) -> Any:
    """``load()``, or ``None`` with a warning when the cache entry is unreadable or stale (it is then rebuilt)."""
    try:
        return load()
    except Exception as exc:
        warnings.warn(
            f"mechgeom: {what} are unreadable or stale ({exc!s:.200}); rebuilding",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def cfg_to_json(cfg: HookedTransformerConfig) -> dict[str, Any]:
    d = dict(cfg.to_dict())  # to_dict() may hand back the live __dict__: never mutate it
    d["dtype"] = str(d["dtype"]).removeprefix("torch.")
    d.pop("device", None)
    d.pop("n_devices", None)
    return d


def cfg_from_json(d: dict[str, Any]) -> HookedTransformerConfig:
    d = dict(d)
    d["dtype"] = getattr(torch, d["dtype"])
    return HookedTransformerConfig(**d)


def save_weights(model: Any, path: Path, sha: str, fmt: int) -> None:
    """Write ``model``'s config and weights (on the CPU) to ``path``, atomically, stamped with the cache layout
    ``fmt`` and the ``sha`` of the file they were built from; :func:`load_weights` reads them back.

    Args:
        model: a ``HookedTransformer`` or ``HookedEncoder``.
        path: the entry's ``.pt`` file.
        sha: the SHA-256 of the source weights.
        fmt: the writing module's cache layout version.
    """
    payload = {
        "format": fmt,
        "sha256": sha,
        "cfg_json": json.dumps(cfg_to_json(model.cfg)),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }
    with atomic_write(path, mode="wb") as f:
        torch.save(payload, f)


def load_weights(path: Path, sha: str, fmt: int) -> tuple[HookedTransformerConfig, dict[str, torch.Tensor]]:
    """The config and weights that :func:`save_weights` wrote to ``path``, on the CPU.

    Args:
        path: the entry's ``.pt`` file.
        sha: the SHA-256 the source weights have now.
        fmt: the reading module's cache layout version.

    Returns:
        ``(cfg, state_dict)``.

    Raises:
        ValueError: the entry has another layout or was built from other weights ("stale cache entry").
    """
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != fmt or payload.get("sha256") != sha:
        raise ValueError("stale cache entry")
    return cfg_from_json(json.loads(payload["cfg_json"])), payload["state_dict"]
