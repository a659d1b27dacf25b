"""The one progress helper: ``tqdm.auto`` bars on a terminal or in Jupyter, plain lines in a log.

:func:`progress` picks its output from the stream it writes to (``sys.stderr`` unless told otherwise):

- a **terminal** (the stream is a TTY) or a **Jupyter kernel**: a ``tqdm.auto`` bar, as before (in a
  kernel the stream is not a TTY, and tqdm.auto draws its notebook widget where ipywidgets exist);
- **anything else** (CI, ``nohup``, ``mechgeom report > log 2>&1``): no carriage returns, only whole
  lines. A line ``"{desc}: 12/40 done (3.1 s)"`` when at least :data:`EVERY_S` seconds and
  :data:`EVERY_FRACTION` of the items have passed since the last line (every :data:`EVERY_S_UNSIZED`
  seconds when the length is unknown), and a last line ``"{desc}: 40/40 done in 12.3 s"``, or
  ``"{desc}: stopped at 12/40 after 3.1 s"`` when the loop ends early. A short loop writes one line.

``enabled=False`` returns the iterable unchanged and writes nothing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

__all__ = ["EVERY_FRACTION", "EVERY_S", "EVERY_S_UNSIZED", "progress"]

#: In a log, an interim line needs at least this many seconds since the last line ...
EVERY_S = 5.0
#: ... and at least this share of the items done since the last line (at most ~10 interim lines).
EVERY_FRACTION = 0.1
#: Seconds between interim lines when the number of items is unknown.
EVERY_S_UNSIZED = 30.0


def progress(
    iterable: Iterable[T],
    *,
    desc: str,
    enabled: bool = True,
    total: int | None = None,
    file: TextIO | None = None,
) -> Iterable[T]:
    """Iterate ``iterable`` with a progress display on ``file`` (default ``sys.stderr``): a ``tqdm.auto``
    bar on a terminal or in Jupyter, progress lines otherwise (see the module); unchanged when ``enabled``
    is False.

    >>> list(progress(range(3), desc="demo", enabled=False))
    [0, 1, 2]
    """
    stream = sys.stderr if file is None else file
    if not enabled or stream is None:  # no stderr at all (pythonw): nothing to show
        return iterable
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if _interactive(stream):
        return tqdm(iterable, desc=desc, total=total, leave=False, file=stream)
    return _lines(iterable, desc, total, stream)


def _interactive(stream: TextIO) -> bool:
    """A terminal, or a Jupyter kernel (the test tqdm.autonotebook makes)."""
    if "ipykernel.zmqshell" in sys.modules:
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _lines(iterable: Iterable[T], desc: str, total: int | None, stream: TextIO) -> Iterator[T]:
    start = last_t = time.monotonic()
    n = last_n = 0
    of = "" if total is None else f"/{total}"
    step = max(1, math.ceil(EVERY_FRACTION * total)) if total else 0
    finished = False
    try:
        for item in iterable:
            yield item
            n += 1  # counted once the caller is done with the item, as tqdm does
            now = time.monotonic()
            wait = EVERY_S if total else EVERY_S_UNSIZED
            due = now - last_t >= wait and n - last_n >= step
            if due and n != total:
                _write(stream, f"{desc}: {n}{of} done ({now - start:.1f} s)")
                last_t, last_n = now, n
        finished = True
    finally:
        elapsed = time.monotonic() - start
        if finished:
            _write(stream, f"{desc}: {n}{of} done in {elapsed:.1f} s")
        else:  # closed early (a break, an error in the loop or in the iterable)
            _write(stream, f"{desc}: stopped at {n}{of} after {elapsed:.1f} s")


def _write(stream: TextIO, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()
