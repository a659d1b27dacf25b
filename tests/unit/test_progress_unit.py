"""mechgeom._progress: tqdm bars on a terminal or in Jupyter, clean lines in a log, nothing when disabled."""

from __future__ import annotations

import io
import re
import sys
import types
from collections.abc import Iterator

import pytest
from tqdm.auto import tqdm

from mechgeom import _progress
from mechgeom._progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """A fake ``time.monotonic`` for ``mechgeom._progress``: the test moves ``now`` by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ipykernel.zmqshell", raising=False)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_progress, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


def lines_of(log: io.StringIO) -> list[str]:
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text  # no carriage returns, no cursor moves
    assert text.endswith("\n")
    return text.splitlines()


def test_a_log_gets_a_line_every_5_s_and_10_percent_then_a_final_line(clock: Clock) -> None:
    log = io.StringIO()
    seen = []
    for i in progress(range(40), desc="items", file=log):
        seen.append(i)
        clock.now += 1.0  # one second per item: 10% (4 items) is due before 5 s are
    assert seen == list(range(40))
    lines = lines_of(log)
    assert lines[:-1] == [f"items: {n}/40 done ({n:.1f} s)" for n in (5, 10, 15, 20, 25, 30, 35)]
    assert lines[-1] == "items: 40/40 done in 40.0 s"


def test_a_line_also_waits_for_10_percent_more_items(clock: Clock) -> None:
    log = io.StringIO()
    for _ in progress(range(100), desc="fast", total=100, file=log):
        clock.now += 0.6  # 5 s pass after 9 items, 10% needs 10
    assert lines_of(log)[0] == "fast: 10/100 done (6.0 s)"
    assert len(lines_of(log)) == 10  # 10, 20, ..., 90, then the final line
    assert lines_of(log)[-1] == "fast: 100/100 done in 60.0 s"


def test_a_short_loop_writes_one_line(clock: Clock) -> None:
    log = io.StringIO()
    assert list(progress(["a", "b", "c"], desc="quick", file=log)) == ["a", "b", "c"]
    assert lines_of(log) == ["quick: 3/3 done in 0.0 s"]


def test_an_unsized_iterable_counts_without_a_total(clock: Clock) -> None:
    def gen() -> Iterator[int]:
        for i in range(70):
            clock.now += 1.0
            yield i

    log = io.StringIO()
    assert sum(progress(gen(), desc="stream", file=log)) == sum(range(70))
    assert lines_of(log) == [
        "stream: 30 done (30.0 s)",
        "stream: 60 done (60.0 s)",
        "stream: 70 done in 70.0 s",
    ]


def test_a_loop_that_stops_early_says_so(clock: Clock) -> None:
    log = io.StringIO()
    for i in progress(range(10), desc="partial", file=log):
        clock.now += 0.5
        if i == 2:
            break
    assert lines_of(log) == ["partial: stopped at 2/10 after 1.5 s"]  # item 2 was not finished

    def failing() -> Iterator[int]:
        yield 1
        raise RuntimeError("reader failed")

    log = io.StringIO()
    with pytest.raises(RuntimeError, match="reader failed"):
        list(progress(failing(), desc="broken", file=log))
    assert lines_of(log) == ["broken: stopped at 1 after 0.0 s"]


def test_nested_loops_write_whole_lines(clock: Clock) -> None:
    log = io.StringIO()
    for _ in progress(range(2), desc="outer", file=log):
        for _ in progress(range(3), desc="inner", file=log):
            clock.now += 1.0
    assert lines_of(log) == [
        "inner: 3/3 done in 3.0 s",
        "inner: 3/3 done in 3.0 s",
        "outer: 2/2 done in 6.0 s",
    ]


def test_stderr_is_the_default_stream(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(progress(range(4), desc="default")) == [0, 1, 2, 3]  # pytest's stderr is no TTY
    err = capsys.readouterr().err
    assert "\r" not in err and re.fullmatch(r"default: 4/4 done in \d+\.\d s\n", err)


def test_a_terminal_gets_a_tqdm_bar() -> None:
    term = Terminal()
    bar = progress(range(5), desc="bar", file=term)
    assert isinstance(bar, tqdm)
    assert list(bar) == list(range(5))
    out = term.getvalue()
    assert "\r" in out and "bar: " in out and "0/5" in out  # tqdm's own output


def test_a_jupyter_kernel_keeps_tqdm_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a kernel stderr is no TTY, but tqdm.auto draws its notebook bar there: keep it.
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    bar = progress(range(3), desc="nb", file=io.StringIO())
    assert isinstance(bar, tqdm)
    assert list(bar) == [0, 1, 2]


@pytest.mark.parametrize("stream", [io.StringIO, Terminal])
def test_disabled_writes_nothing(stream: type[io.StringIO], monkeypatch: pytest.MonkeyPatch) -> None:
    out = stream()
    data = [1, 2, 3]
    assert progress(data, desc="quiet", enabled=False, file=out) is data
    monkeypatch.setattr(sys, "stderr", out)
    assert list(progress(iter(data), desc="quiet", enabled=False)) == data
    assert out.getvalue() == ""


def test_no_stderr_at_all_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", None)  # pythonw
    data = range(3)
    assert progress(data, desc="none") is data
