"""The one atomic-write helper: every file mechgeom writes goes through a temporary file and a rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pandas as pd

__all__ = ["atomic_write", "read_frame", "write_frame"]


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; rename it over ``path`` only if the block succeeds.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_write(d / "x.txt") as f:
    ...     _ = f.write("hi")
    >>> (d / "x.txt").read_text()
    'hi'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the permissions open() would
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_frame(df: pd.DataFrame, path: str | Path) -> Path:
    """Write a DataFrame atomically as CSV or Parquet (by the suffix)."""
    path = Path(path)
    if path.suffix == ".parquet":
        with atomic_write(path, "wb") as f:
            df.to_parquet(f, index=False)
    elif path.suffix == ".csv":
        with atomic_write(path, "w") as f:
            df.to_csv(f, index=False)
    else:
        raise ValueError(f"unsupported table format {path.suffix!r}; use .csv or .parquet")
    return path


def read_frame(path: str | Path) -> pd.DataFrame:
    """Read a table written by :func:`write_frame`."""
    path = Path(path)
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
