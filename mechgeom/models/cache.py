"""The model cache's shared pieces (private): where processed weights live, file hashes, quiet loading,
unreadable-cache handling and config round trips; used by
:mod:`mechgeom.models.decoders` and :mod:`mechgeom.models.encoders`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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
    "quiet",
    "read_cache",
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
