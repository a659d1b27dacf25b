"""The sweep store: keyed rows in an append-only, checksummed log, one writer at a time, and a table made from it.

A store whose table is ``run.csv`` (or ``.parquet``) keeps three files beside it:

- ``run.log.jsonl``, the record (:mod:`mechgeom.sweep.log`): a header with the key, the columns and the
  fingerprint of the experiment, then one line per row, appended as items finish (O(1) per row);
- ``run.lock``, locked with ``flock`` while a process writes (:meth:`RowStore.writing`): a second writer stops
  with :class:`StoreLocked` naming the holder's PID and writes nothing; the kernel releases the lock when the
  holder exits or is killed, so no stale lock is left;
- ``run.csv``, the table callers read, written atomically (temporary file and rename) at the end of every
  write session, so readers never see a half-written table.

Opening a store reads its log strictly and compares the stored fingerprint with this run's (weights, dtype,
settings, extra hooks: :mod:`mechgeom.sweep.fingerprint`); any difference is a ``ValueError`` naming it. A table
without a log was written by an earlier mechgeom and is never resumed silently
(:mod:`mechgeom.sweep.legacy`).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import warnings
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mechgeom._io import write_frame
from mechgeom.sweep.fingerprint import (
    Unfingerprintable,
    describe,
    hooks_fingerprint,
    model_dtype,
    model_label,
    weights_digest,
)
from mechgeom.sweep.legacy import adoption_marker, open_legacy
from mechgeom.sweep.log import (
    LOG_VERSION,
    ParsedLog,
    StoreWarning,
    encode_line,
    kind_of,
    norm_key,
    parse_log,
    store_paths,
)

__all__ = ["RowStore", "StoreLocked", "read_store", "remove_store"]

SETTING_PREFIX = "setting_"


class StoreLocked(OSError):
    """Another process (or another store object) is writing this store; nothing was written."""


def remove_store(path: str | Path) -> None:
    """Delete a store: its table, log and lock file (those that exist). Only when no sweep writes it."""
    for p in (Path(path), *store_paths(path)):
        p.unlink(missing_ok=True)


def _writer_active(lock: Path) -> bool:
    """Whether a process holds the store's write lock now."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a shared lock taken here
    return False


def read_store(path: str | Path) -> pd.DataFrame:
    """The rows of the store whose table is ``path``, read from its log without locking or writing (e.g. to
    watch a running sweep); empty when there is no log. A truncated last line is left out (with a warning
    unless a writer is appending it now).

    Raises:
        StoreCorrupt: a malformed line (see :func:`mechgeom.sweep.log.parse_log`).
    """
    log, lock = store_paths(path)
    if not log.exists():
        return pd.DataFrame()
    data = log.read_bytes()
    torn = bool(data) and not data.endswith(b"\n")
    parsed = parse_log(log, data, warn_torn=torn and not _writer_active(lock))
    if parsed.header is None:
        return pd.DataFrame()
    return pd.DataFrame.from_records(list(parsed.rows.values()), columns=parsed.header["columns"])


def _py(value: Any) -> Any:
    """A value as plain Python (numpy scalars unwrapped, pandas' missing values as None)."""
    if isinstance(value, np.generic):
        return value.item()
    if value is pd.NA or value is pd.NaT:
        return None
    return value


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte (a regular file takes them in one call unless the disk fills)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RowStore:
    """Rows under the ``key`` columns, tied to a fingerprint of the experiment that computed them.

    Args:
        path: the table (``.csv`` or ``.parquet``; the log and lock sit beside it, see :func:`store_paths`), or
            None for a store in memory.
        key: the columns that identify a row; a key is stored once.
        settings: what the rows depend on besides the model (layers, seed, tokens, ``means``...), each
            compared as :func:`~mechgeom.sweep.fingerprint.describe` text; they also fill ``setting_<name>``
            columns of the table.
        model: the model the rows are computed on: its name, dtype and weights digest (taken now, so an edit
            made after loading counts) join the fingerprint.
        extra_hooks: ``(hook point, fn)`` pairs attached in every pass: their code and data join the
            fingerprint (:func:`~mechgeom.sweep.fingerprint.hooks_fingerprint`; a hook without stable
            content is refused with a request for :func:`~mechgeom.sweep.fingerprint.labelled_hook`).
        what, fresh: the store's name in messages and how to start afresh.

    Raises:
        ValueError: a stored fingerprint that differs (each difference named, stored vs now), a table without
            a log (an earlier version's), or another key.
        StoreCorrupt: a malformed log line (file, line, column and the repair).
        Unfingerprintable: an extra hook without stable content (only with a ``path``).
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        key: Sequence[str],
        settings: Mapping[str, Any],
        model: Any = None,
        extra_hooks: Sequence[tuple[Any, Any]] = (),
        what: str = "sweep store",
        fresh: str = "delete it or choose another path",
    ) -> None:
        if not key:
            raise ValueError("a row store needs at least one key column")
        self.path = None if path is None else Path(path)
        if self.path is not None and self.path.suffix not in (".csv", ".parquet"):
            raise ValueError(f"{what} must end in .csv or .parquet, got {self.path.name!r}")
        self.key = list(key)
        self.settings = dict(settings)
        self.what, self.fresh = what, fresh
        self._model, self._hooks = model, tuple(extra_hooks)
        self._weights: str | None = None
        # a store without a path checks nothing on resume, so a setting without stable content is no error there
        self.fingerprint = self._fingerprint() if self.path is not None else self._settings_text(strict=False)
        self.columns: list[str] | None = None
        self.kinds: dict[str, str] = {}
        self._rows: dict[tuple[Hashable, ...], dict[str, Any]] = {}
        self.done: set[tuple[Hashable, ...]] = set()
        self._header: dict[str, Any] | None = None
        self._seen: tuple[int, int] | None = None  # (inode, size) of the log as last read
        self._torn_at: tuple[int, int] | None = None  # (inode, offset) of a torn line already warned about
        self._end = 0
        self._lock_fd: int | None = None
        self._log_fd: int | None = None
        self._depth = 0
        self._frame: pd.DataFrame | None = None
        if self.path is not None:
            self.log_path, self.lock_path = store_paths(self.path)
            if self.log_path.exists():
                self._read()
            elif self.path.exists():
                columns, rows, note = open_legacy(self)  # refuses, or converts a table the user adopted
                if rows:
                    with self.writing():
                        self._add_records(columns, rows, note=note)
                    adoption_marker(self.path).unlink(missing_ok=True)

    # ----------------------------------------------------------------- fingerprint

    def _settings_text(self, *, strict: bool = True) -> dict[str, str]:
        out = {}
        for k, v in self.settings.items():
            try:
                out[k] = describe(v, where=f"the setting {k!r}")
            except Unfingerprintable:
                if strict:
                    raise
                out[k] = f"<{type(v).__module__}.{type(v).__qualname__}>"
        return out

    def _fingerprint(self) -> dict[str, str]:
        fp = self._settings_text()
        if self._model is not None:
            fp.setdefault("model", model_label(self._model))
            fp["dtype"] = model_dtype(self._model)
            fp["weights"] = self.weights() or ""
        if self._model is not None or self._hooks:
            fp["extra_hooks"] = hooks_fingerprint(self._hooks)
        return fp

    def weights(self) -> str | None:
        """The digest of the model's weights (taken once per store), or None without a model."""
        if self._weights is None and self._model is not None:
            self._weights = weights_digest(self._model)
        return self._weights

    def _check(self, parsed: ParsedLog) -> None:
        assert parsed.header is not None and self.path is not None
        if parsed.header["key"] != self.key:
            raise ValueError(
                f"{self.what} {self.path} keys its rows by {parsed.header['key']}, this sweep by {self.key}; "
                f"{self.fresh} to start a fresh sweep"
            )
        stored, now = parsed.fingerprint, self.fingerprint
        diffs = [
            f"{k}: stored {stored.get(k, '(not recorded)')}, now {now.get(k, '(not given)')}"
            for k in dict.fromkeys([*now, *stored])
            if stored.get(k) != now.get(k)
        ]
        if diffs:
            raise ValueError(
                f"{self.what} {self.path} was written with other settings ({'; '.join(diffs)}); "
                f"{self.fresh} to start a fresh sweep"
            )

    # ----------------------------------------------------------------- reading

    def _read(self) -> None:
        """Read the log (strictly) into memory; warn once about a torn last line unless a writer is on it."""
        data = self.log_path.read_bytes()
        ino = os.stat(self.log_path).st_ino
        torn = bool(data) and not data.endswith(b"\n")
        tail = (ino, data.rfind(b"\n") + 1)
        warn = (
            torn
            and self._torn_at != tail
            and (self._lock_fd is not None or not _writer_active(self.lock_path))
        )
        parsed = parse_log(self.log_path, data, warn_torn=warn)
        if warn:
            self._torn_at = tail
        if parsed.header is not None:
            self._check(parsed)
        self._header = parsed.header
        self.columns = None if parsed.header is None else list(parsed.header["columns"])
        self.kinds = {} if parsed.header is None else dict(parsed.header["kinds"])
        self._rows = parsed.rows
        self.done = set(parsed.rows)
        self._seen, self._end = (ino, len(data)), parsed.end
        self._frame = None

    def _refresh(self) -> None:
        """Under the lock: read what another writer appended since, and cut a torn last line."""
        if not self.log_path.exists():
            if self._header is not None:  # the log was removed: start afresh
                self._header, self.columns, self.kinds, self._rows, self.done = None, None, {}, {}, set()
                self._frame = None
            return
        st = os.stat(self.log_path)
        if (st.st_ino, st.st_size) != self._seen:
            self._read()
        if self._end < st.st_size:  # a torn last line, or the log holds only part of its header
            os.truncate(self.log_path, self._end)
            self._seen = (st.st_ino, self._end)

    # ----------------------------------------------------------------- writing

    @contextlib.contextmanager
    def writing(self) -> Iterator[RowStore]:
        """A write session: the store's lock is held throughout (re-entrant); on entry the log is read again
        (another writer may have appended before) and a torn last line is cut; on exit the table is written
        atomically (also after an error, then without raising its own).

        Raises:
            StoreLocked: another writer holds the lock (its PID is named); nothing is written.
        """
        if self.path is None or self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self._lock()
        try:
            self._refresh()
            self._depth, failed = 1, True
            try:
                yield self
                failed = False
            finally:
                self._depth = 0
                if self._log_fd is not None:
                    os.close(self._log_fd)
                    self._log_fd = None
                self._write_table(quiet=failed)
        finally:
            self._unlock()

    def _lock(self) -> None:
        assert self.path is not None
        try:
            self.lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            if not self.lock_path.exists():
                raise OSError(
                    err.errno,
                    f"cannot create the lock file {self.lock_path} of {self.what} {self.path}: {err.strerror}; "
                    "make the folder writable (or choose another path) and rerun",
                ) from err
            fd = os.open(self.lock_path, os.O_RDONLY)  # a read-only folder: lock without recording the PID
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if not isinstance(err, BlockingIOError):
                raise OSError(
                    err.errno,
                    f"cannot lock {self.lock_path} of {self.what} {self.path}: {err.strerror} (this file system "
                    "may not support file locks); choose a path on a local disk",
                ) from err
            who = "another store object in this process" if holder == str(os.getpid()) else "another process"
            raise StoreLocked(
                f"{self.what} {self.path} is being written by {who} (PID {holder or 'unknown, starting'}; "
                f"{self.lock_path} holds its lock), so this run stopped before writing anything: two writers "
                "would each lose the other's rows. Wait until it ends (or stop it), or give this run another path"
            ) from None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # releases the flock

    def _append(self, records: Sequence[Mapping[str, Any]], header: dict[str, Any] | None = None) -> None:
        """Append lines (with ``header`` first) in one write and fsync; on an error the partial line is cut
        and an ``OSError`` says the record is intact. A store in memory writes nothing."""
        self._frame = None
        if self.path is None:
            return
        assert self._depth
        data = b"".join([*([encode_line(header)] if header else []), *map(encode_line, records)])
        try:
            if self._log_fd is None:
                self._log_fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            before = os.fstat(self._log_fd).st_size
            try:
                _write_all(self._log_fd, data)
                os.fsync(self._log_fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._log_fd, before)
                raise
        except OSError as err:
            raise OSError(
                err.errno,
                f"could not append to {self.what} {self.log_path}: {err.strerror}; the rows stored before are "
                "intact. Free some space or make the folder writable, then rerun to resume",
            ) from err
        self._end += len(data)
        self._seen = (os.fstat(self._log_fd).st_ino, self._end)
        self._frame = None

    def write_table(self) -> None:
        """Write the table now (atomically), e.g. after each step of a long write session; a session writes
        it at its end anyway. Nothing happens without a log (no row was ever stored)."""
        if self.path is not None and self.log_path.exists():
            self._write_table(quiet=False)

    def _write_table(self, *, quiet: bool) -> None:
        """Write the table atomically from the rows in memory (the log's), if there is a log; ``quiet``
        turns a failure into a warning (on the way out of a session that failed)."""
        assert self.path is not None
        if not self.log_path.exists():
            return
        try:
            write_frame(self.frame, self.path)
        except OSError as err:
            msg = f"could not write the table {self.path}: {err}; the record {self.log_path} is intact, rerun to write it"
            if not quiet:
                raise OSError(err.errno, msg) from err
            warnings.warn(msg, StoreWarning, stacklevel=3)

    # ----------------------------------------------------------------- rows

    def _records(
        self, rows: pd.DataFrame | Sequence[Mapping[str, Any]]
    ) -> tuple[list[str], list[dict[str, Any]]]:
        if isinstance(rows, pd.DataFrame):
            return [str(c) for c in rows.columns], rows.to_dict("records")  # type: ignore[return-value]
        records = [dict(r) for r in rows]
        return list(dict.fromkeys(c for r in records for c in r)), records

    def _clean(self, columns: list[str], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rows as plain values in the store's columns, checked: no missing or empty value, one kind per column
        (the first rows stored fix the columns and kinds). A store in memory keeps rows as they come (nothing
        has to survive a round trip through the log)."""
        if self.path is None:
            self.columns = list(dict.fromkeys([*(self.columns or []), *columns]))
            return [{c: _py(v) for c, v in r.items()} for r in records]
        kinds = self.kinds
        if self.columns is None:
            kinds = {}
            for c in columns:
                found = {kind_of(v) for r in records if (v := _py(r.get(c))) is not None and not _nan(v)}
                kinds[c] = (found.pop() or "mixed") if len(found) == 1 else ("num" if not found else "mixed")
        elif set(columns) != set(self.columns):
            raise ValueError(
                f"rows with the columns {columns} cannot join {self.what} {self.path}, whose rows have {self.columns}"
            )
        out = []
        for r in records:
            row = {c: _py(r.get(c)) for c in (self.columns or columns)}
            for c, v in row.items():
                kind = kinds.get(c, "mixed")
                if v is None or v == "" or (kind == "str" and _nan(v)):
                    problem = "an empty value"
                elif kind_of(v) != kind:
                    problem = f"{v!r}, not of the column's kind ({kind})"
                elif c in self.key and _nan(v):
                    problem = "a NaN key"
                else:
                    continue
                raise ValueError(
                    f"a row for {self.what} has {problem} in column {c!r} (key {[row.get(k) for k in self.key]}); "
                    "the store keeps numbers, texts and booleans, one kind per column, none empty"
                )
            out.append(row)
        if self.columns is None:
            self.kinds = kinds
        return out

    def _add_records(
        self, columns: list[str], records: list[dict[str, Any]], *, note: str | None = None
    ) -> int:
        """Append the rows whose key is new (inside a write session); ``note`` marks an adopted record."""
        new: dict[tuple[Hashable, ...], dict[str, Any]] = {}
        for r in records:
            k = norm_key(_py(r[c]) for c in self.key)
            if k not in self.done and k not in new:
                new[k] = r
        if not new:
            return 0
        rows = self._clean(columns, list(new.values()))
        header: dict[str, Any] | None = None
        if self._header is None:
            header = {
                "mechgeom_store": LOG_VERSION,
                "key": self.key,
                "columns": self.columns or columns,
                "kinds": self.kinds,
                "fingerprint": self.fingerprint,
                **({"adopted_from": note} if note else {}),
            }
        self._append([{"row": r} for r in rows], header)
        if header is not None:
            self._header, self.columns = header, header["columns"]
        for k, r in zip(new, rows, strict=True):
            self._rows[k] = r
            self.done.add(k)
        return len(rows)

    def __contains__(self, key: object) -> bool:
        """Whether a row with this key (a tuple of key-column values) is stored."""
        return isinstance(key, tuple) and norm_key(key) in self.done

    def finished(self, item: Any) -> bool:
        """Whether every row the item declares is stored (an item that declares none never is)."""
        return bool(item.rows) and all(norm_key(k) in self.done for k in item.rows)

    def keys_of(self, rows: pd.DataFrame) -> list[tuple[Hashable, ...]]:
        """The normalised keys of a frame's rows (which must have the key columns)."""
        return [norm_key(k) for k in zip(*(rows[c] for c in self.key), strict=True)]

    def add(self, rows: pd.DataFrame | Sequence[Mapping[str, Any]]) -> int:
        """Store the rows whose key is new (also new within ``rows``): one appended line each, in one write.

        Outside a write session (:meth:`writing`, which :func:`~mechgeom.sweep.run_sweep` holds) the call is
        its own session: it takes the lock and writes the table.

        Returns:
            How many rows were added.

        Raises:
            ValueError: rows without the key columns, with other columns than the stored rows, or with a
                missing, empty or mistyped value.
            StoreLocked: another writer holds the store.
        """
        columns, records = self._records(rows)
        missing = [c for c in self.key if c not in columns]
        if missing:
            raise ValueError(f"rows lack the key column(s) {missing} of {self.what}")
        if not records:
            return 0
        with self.writing():
            return self._add_records(columns, records)

    def discard(self, keys: Iterable[Iterable[Any]]) -> int:
        """Drop the rows with these keys (tuples of key-column values): one tombstone line; a later row may
        take the key again. For a store whose entries are replaced (the report's stages).

        Returns:
            How many rows went.
        """
        wanted = list(dict.fromkeys(norm_key(k) for k in keys))
        with self.writing():
            gone = [k for k in wanted if k in self.done]
            if gone:
                self._append([{"discard": [list(k) for k in gone]}])
                for k in gone:
                    self._rows.pop(k, None)
                    self.done.discard(k)
        return len(gone)

    @property
    def _setting_cols(self) -> dict[str, Any]:
        scalar = (str, int, float, bool)
        return {
            SETTING_PREFIX + k: self.settings[k]
            if isinstance(self.settings.get(k), scalar)
            else self.fingerprint[k]
            for k in self.fingerprint
        }

    @property
    def frame(self) -> pd.DataFrame:
        """The stored rows with the fingerprint in ``setting_<name>`` columns (the table's content)."""
        if self._frame is None:
            self._frame = self.rows().assign(**self._setting_cols)
        return self._frame

    def rows(self) -> pd.DataFrame:
        """The stored rows, in the order they were stored, without the setting columns."""
        columns = self.columns or self.key
        if not self._rows:
            return pd.DataFrame(columns=columns)
        return pd.DataFrame.from_records(list(self._rows.values()), columns=columns)


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)
