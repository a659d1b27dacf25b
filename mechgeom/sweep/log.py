"""The sweep store's record: an append-only log of JSON lines, each behind a CRC32 of its text, read strictly.

A line is ``<8 hex digits: CRC32 of the text after the space> <one JSON object>\\n``. The first line is the
header (``{"mechgeom_store": 1, "key": [...], "columns": [...], "kinds": {...}, "fingerprint": {...}}``);
then ``{"row": {column: value}}`` lines and ``{"discard": [[key values], ...]}`` lines (tombstones: the rows
of those keys are gone, a later row may take the key again).

Reading is strict (:func:`parse_log`): a last line without its newline is what a crash during a write leaves,
and is dropped with one warning (its rows are computed again); anything else malformed is a
:class:`StoreCorrupt` naming the file, the line and the column, with the way to repair it
(:func:`repair_log`, or ``python -m mechgeom.sweep repair <log>``).

>>> line = encode_line({"row": {"x": 1, "y": 0.5}})
>>> line
b'22a36cc7 {"row":{"x":1,"y":0.5}}\\n'
>>> decode_line(line[:-1], "log", 2)
{'row': {'x': 1, 'y': 0.5}}
"""

from __future__ import annotations

import json
import math
import os
import warnings
import zlib
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LOG_VERSION",
    "ParsedLog",
    "StoreCorrupt",
    "StoreWarning",
    "decode_line",
    "encode_line",
    "norm_key",
    "parse_log",
    "repair_log",
    "store_paths",
]

#: The log layout this code writes and reads.
LOG_VERSION = 1

#: Column kinds: numbers (int or float, NaN and infinities included), text, booleans.
KINDS = ("num", "str", "bool")


class StoreCorrupt(ValueError):
    """A malformed record line: the message names the file, the line and the column, and how to repair."""


class StoreWarning(UserWarning):
    """A record was read with a line dropped (the truncated last line a crash leaves)."""


def norm_value(value: Any) -> Hashable:
    """A key value as plain Python: numpy scalars unwrapped, floats rounded to 10 decimals (so that
    ``0.1 + 0.2`` and ``0.3`` name the same key)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return round(value, 10)
    return value  # type: ignore[no-any-return]


def norm_key(key: Iterable[Any]) -> tuple[Hashable, ...]:
    """A key (the values of the key columns) as a tuple of :func:`norm_value`."""
    return tuple(norm_value(v) for v in key)


def kind_of(value: Any) -> str | None:
    """``num``, ``str`` or ``bool`` for a stored value; ``None`` for anything else."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "num"
    if isinstance(value, str):
        return "str"
    return None


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One log line: the CRC32 of the compact JSON text (8 hex digits), a space, the text, a newline."""
    text = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=True).encode()
    return b"%08x %s\n" % (zlib.crc32(text), text)


def store_paths(path: str | Path) -> tuple[Path, Path]:
    """The log and the lock file of the store whose table is ``path``: ``<stem>.log.jsonl``, ``<stem>.lock``.

    >>> [p.name for p in store_paths("out/run.per_text.csv")]
    ['run.per_text.log.jsonl', 'run.per_text.lock']
    """
    p = Path(path)
    return p.with_name(f"{p.stem}.log.jsonl"), p.with_name(f"{p.stem}.lock")


def _repair_hint(log: Path | str) -> str:
    return (
        f"To repair it, run `python -m mechgeom.sweep repair {log}`: it moves the damaged line(s) to "
        f"{log}.rejected and keeps every other row; the rows of those lines are computed again on the next "
        "run. (Or mend the line by hand: its first 8 characters are the CRC32, in hex, of the text after the "
        "space.)"
    )


_HEADER_HINT = (
    "The header ties the rows to the experiment that computed them and cannot be repaired: restore the log "
    "from a backup, or move it aside to compute the sweep afresh"
)


def _bad(log: Path | str, line: int, column: int | str, problem: str) -> StoreCorrupt:
    """The error of a malformed line; line 1 is the header, which no repair can restore."""
    col = f"column {column!r}" if isinstance(column, str) else f"column {column}"
    hint = _HEADER_HINT if line == 1 else _repair_hint(log)
    return StoreCorrupt(f"{log}, line {line}, {col}: {problem}. {hint}")


def decode_line(raw: bytes, log: Path | str, number: int) -> dict[str, Any]:
    """The JSON object of one line (without its newline), its checksum verified.

    Raises:
        StoreCorrupt: not ``<crc> <json object>``, a checksum that does not match, bad UTF-8 or JSON.
    """
    head, text = raw[:8], raw[9:]
    if len(raw) < 10 or raw[8:9] != b" " or any(c not in b"0123456789abcdef" for c in head):
        shown = raw[:40].decode("utf-8", "backslashreplace")
        raise _bad(
            log,
            number,
            1,
            f"not a record line ({shown!r}; a line is 8 hex digits of CRC32, a space, a JSON object)",
        )
    if int(head, 16) != zlib.crc32(text):
        raise _bad(
            log, number, 10, "the checksum does not match the line's text (the line was changed or damaged)"
        )
    try:
        obj = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise _bad(log, number, 10 + err.start, "bytes that are not UTF-8") from None
    except json.JSONDecodeError as err:
        raise _bad(log, number, 9 + err.colno, f"not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict) or (len(obj) != 1 and "mechgeom_store" not in obj):
        raise _bad(log, number, 10, "not a record (a header, row or discard object)")
    return obj


@dataclass
class ParsedLog:
    """A log read by :func:`parse_log`: the header, the live rows by key (in order), the line each came
    from, the byte offset where the valid lines end, whether a torn last line followed, and the line count."""

    header: dict[str, Any] | None = None
    rows: dict[tuple[Hashable, ...], dict[str, Any]] = field(default_factory=dict)
    line_of: dict[tuple[Hashable, ...], int] = field(default_factory=dict)
    end: int = 0
    torn: bool = False
    lines: int = 0

    @property
    def fingerprint(self) -> dict[str, str]:
        return dict((self.header or {}).get("fingerprint", {}))


def _check_header(obj: dict[str, Any], log: Path | str) -> dict[str, Any]:
    if "mechgeom_store" not in obj:
        raise _bad(log, 1, 10, "the first line must be the store's header")
    if obj.get("mechgeom_store") != LOG_VERSION:
        raise StoreCorrupt(  # a layout of another version: not damage
            f"{log}, line 1: a sweep log of layout {obj.get('mechgeom_store')!r}, but this mechgeom reads layout "
            f"{LOG_VERSION}; run the mechgeom that wrote it, or move the log aside to compute the sweep afresh"
        )
    key, columns, kinds = obj.get("key"), obj.get("columns"), obj.get("kinds")
    ok = (
        isinstance(key, list)
        and isinstance(columns, list)
        and isinstance(kinds, dict)
        and set(key) <= set(columns)
        and set(kinds) == set(columns)
        and set(kinds.values()) <= set(KINDS)
        and isinstance(obj.get("fingerprint"), dict)
    )
    if not ok:
        raise _bad(log, 1, 10, "the header lacks its key, columns, kinds or fingerprint")
    return obj


def check_row(row: Any, header: Mapping[str, Any], log: Path | str, number: int) -> dict[str, Any]:
    """A row object checked against the header's columns and kinds (every value present, none empty, each of
    its column's kind; key values finite)."""
    if not isinstance(row, dict):
        raise _bad(log, number, 10, "a row must be a JSON object of column values")
    for col in row:
        if col not in header["kinds"]:
            raise _bad(log, number, col, f"a column the store does not have (it has {header['columns']})")
    for col in header["columns"]:
        if col not in row:
            raise _bad(log, number, col, "missing value")
        value, kind = row[col], header["kinds"][col]
        if value is None or value == "":
            raise _bad(log, number, col, "empty value")
        if kind_of(value) != kind:
            what = {"num": "a number", "str": "a text", "bool": "true or false"}[kind]
            raise _bad(log, number, col, f"not {what}: {value!r}")
        if col in header["key"] and isinstance(value, float) and not math.isfinite(value):
            raise _bad(log, number, col, f"a key value must be finite, got {value!r}")
    return row


def same_value(a: Any, b: Any) -> bool:
    """Equal values (two NaN are the same value)."""
    return bool(a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)))


def _key_text(header: Mapping[str, Any], row: Mapping[str, Any]) -> str:
    return "(" + ", ".join(f"{c}={row[c]!r}" for c in header["key"]) + ")"


def parse_log(log: Path, data: bytes, *, warn_torn: bool = True) -> ParsedLog:
    """Read a log's bytes strictly.

    Args:
        log: its path (named in messages).
        data: its bytes.
        warn_torn: warn (:class:`StoreWarning`) when the last line lacks its newline; a reader that knows a
            writer is appending passes False (the line is being written).

    Returns:
        The :class:`ParsedLog`; a torn last line is left out (``torn``; ``end`` is where it starts).

    Raises:
        StoreCorrupt: any other malformed line, an empty line, a first line that is no header, a row that
            does not fit the header, or a key stored twice with other values (naming both lines).
    """
    out = ParsedLog()
    lines = data.split(b"\n")
    if lines[-1]:  # no newline at the end: a write cut short (a crash), dropped and computed again
        out.torn = True
        if warn_torn:
            warnings.warn(
                f"{log}: its last line ({len(lines)}) is incomplete, the trace of a crash during a write; "
                "it is dropped and its rows are computed again",
                StoreWarning,
                stacklevel=3,
            )
    offset = 0
    for number, raw in enumerate(lines[:-1], 1):
        if not raw:
            raise _bad(log, number, 1, "an empty line")
        obj = decode_line(raw, log, number)
        offset += len(raw) + 1
        if number == 1:
            out.header = _check_header(obj, log)
        elif "row" in obj:
            assert out.header is not None
            row = check_row(obj["row"], out.header, log, number)
            k = norm_key(row[c] for c in out.header["key"])
            if k in out.rows:
                prev = out.rows[k]
                diff = [c for c in out.header["columns"] if not same_value(prev[c], row[c])]
                if diff:
                    c = diff[0]
                    raise _bad(
                        log,
                        number,
                        c,
                        f"the key {_key_text(out.header, row)} of line {out.line_of[k]} is stored again with "
                        f"another value ({c}: {prev[c]!r} on line {out.line_of[k]}, {row[c]!r} here); the repair "
                        "moves both lines aside",
                    )
                continue  # the same row twice: one is kept
            out.rows[k] = row
            out.line_of[k] = number
        elif "discard" in obj and isinstance(obj["discard"], list):
            assert out.header is not None
            for key in obj["discard"]:
                if not isinstance(key, list) or len(key) != len(out.header["key"]):
                    raise _bad(log, number, 10, f"a discarded key must list {len(out.header['key'])} values")
                out.rows.pop(norm_key(key), None)
                out.line_of.pop(norm_key(key), None)
        else:
            what = "the header" if "mechgeom_store" in obj else "a record other than a row or a discard"
            raise _bad(log, number, 10, f"{what} is not expected here")
        out.lines = number
    out.end = offset
    return out


def repair_log(log: str | Path) -> tuple[int, int]:
    """Move the damaged lines of a log to ``<log>.rejected``: lines that fail :func:`parse_log`'s checks,
    both lines of a key stored twice with other values, and a truncated last line; the log is rewritten
    atomically with every other line. Run it only while no sweep writes the store.

    Returns:
        ``(kept, moved)`` line counts.

    Raises:
        StoreCorrupt: the header itself is damaged (the rows could not be tied to an experiment: move the log
            aside to compute the sweep afresh).
    """
    from mechgeom._io import atomic_write

    log = Path(log)
    lines = log.read_bytes().split(b"\n")
    torn = [lines.pop()] if lines[-1] else []
    lines = lines[:-1] if not torn else lines
    if not lines:
        raise StoreCorrupt(f"{log} has no header line. {_HEADER_HINT}")
    header = _check_header(decode_line(lines[0], log, 1), log)
    bad: set[int] = set()
    seen: dict[tuple[Hashable, ...], tuple[int, dict[str, Any]]] = {}
    for number, raw in enumerate(lines[1:], 2):
        try:
            obj = decode_line(raw, log, number)
            if "row" in obj:
                row = check_row(obj["row"], header, log, number)
                k = norm_key(row[c] for c in header["key"])
                if k in seen and any(not same_value(seen[k][1][c], row[c]) for c in header["columns"]):
                    bad |= {seen[k][0], number}
                seen.setdefault(k, (number, row))
            elif "discard" in obj:
                for key in obj["discard"]:
                    seen.pop(norm_key(key), None)
        except StoreCorrupt:
            bad.add(number)
    keep = [raw for n, raw in enumerate(lines, 1) if n not in bad]
    moved = [raw for n, raw in enumerate(lines, 1) if n in bad] + torn
    if moved:
        with open(f"{log}.rejected", "ab") as f:
            f.write(b"".join(raw + b"\n" for raw in moved))
            f.flush()
            os.fsync(f.fileno())
        with atomic_write(log, "wb") as f:
            f.write(b"".join(raw + b"\n" for raw in keep))
    return len(keep), len(moved)
