"""The sweep store (mechgeom.sweep.store and .log): rows appended to a checksummed log, never rewritten; one
writer at a time, across processes, with no stale lock after a SIGKILL; the strict reader and its repair; tables
of the earlier version; a corpus extended or re-batched reusing the record."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens

from mechgeom.analyses import faithfulness as fa
from mechgeom.analyses.faithfulness import harness
from mechgeom.sweep import (
    Item,
    RowStore,
    StoreCorrupt,
    StoreLocked,
    StoreWarning,
    read_store,
    repair_log,
    request_adoption,
    run_sweep,
    store_paths,
)
from mechgeom.sweep.log import encode_line, parse_log

ROOT = Path(__file__).resolve().parents[2]


def _items(n_items: int = 8, per_item: int = 5) -> list[Item]:
    return [
        Item(key=(b,), rows=tuple((b * per_item + i,) for i in range(per_item)), data=b)
        for b in range(n_items)
    ]


class Rows:
    """Work: item ``b`` gives ``per_item`` rows ``x, y = x * x, text``; ``delay`` seconds each."""

    def __init__(self, per_item: int = 5, delay: float = 0.0) -> None:
        self.per_item, self.delay = per_item, delay

    def __call__(self, model: object, item: Item) -> pd.DataFrame:
        time.sleep(self.delay)
        xs = range(item.data * self.per_item, (item.data + 1) * self.per_item)
        return pd.DataFrame({"x": list(xs), "y": [x * x * 0.5 for x in xs], "text": [f"t{x}" for x in xs]})


def _store(path: Path, **settings: object) -> RowStore:
    return RowStore(path, key=["x"], settings={"n": 1, **settings})


def _fork_sweep(path: Path, delay: float) -> int:
    """Run the sweep of :func:`_items` on ``path`` in a forked child (no start-up cost); returns its PID."""
    pid = os.fork()
    if pid == 0:  # the child: run, then leave without pytest's exit handlers
        code = 0
        try:
            run_sweep(_items(), Rows(delay=delay), _store(path), verbose=False)
        except BaseException:
            code = 1
        os._exit(code)
    return pid


def _wait_rows(path: Path, n: int, pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(read_store(path)) < n:
        done, status = os.waitpid(pid, os.WNOHANG)
        assert done == 0, f"the sweep exited early ({status})"
        assert time.monotonic() < deadline, "too few rows in time"
        time.sleep(0.005)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


# --------------------------------------------------------------------------- appending, locking, SIGKILL


def test_rows_are_appended_as_items_finish_and_the_log_is_never_rewritten(tmp_path):
    path = tmp_path / "s.csv"
    log, _ = store_paths(path)
    seen: list[tuple[int, bytes]] = []

    def watch(item, rows):
        seen.append((os.stat(log).st_ino, log.read_bytes()))
        assert not path.exists()  # the table is written once, at the end

    run_sweep(_items(4), Rows(), _store(path), verbose=False, on_item=watch)
    assert len({ino for ino, _ in seen}) == 1  # one file, appended to
    for (_, a), (_, b) in itertools.pairwise(seen):
        assert b.startswith(a) and b.count(b"\n") == a.count(b"\n") + 5  # 5 more lines, the rest unchanged
    assert seen[0][1].count(b"\n") == 1 + 5  # the header, then the first item's rows
    table = pd.read_csv(path)
    assert table["x"].tolist() == list(range(20)) and set(table.columns) == {"x", "y", "text", "setting_n"}


def test_a_writer_in_another_process_is_named_and_a_sigkill_leaves_no_stale_lock(tmp_path):
    path = tmp_path / "s.csv"
    pid = _fork_sweep(path, delay=0.2)
    try:
        _wait_rows(path, 5, pid)
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        with pytest.raises(StoreLocked, match=rf"{path} is being written by another process \(PID {pid};"):
            run_sweep(_items(), Rows(), _store(path), verbose=False)
        after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        assert {k: v for k, v in after.items() if k != "s.log.jsonl"} == {
            k: v for k, v in before.items() if k != "s.log.jsonl"
        }
        assert after["s.log.jsonl"].startswith(before["s.log.jsonl"])  # only the holder appended
    finally:
        _kill(pid)
    store = run_sweep(_items(), Rows(), _store(path), verbose=False)  # the kernel released the lock
    assert store.rows()["x"].tolist() == list(range(40))


def test_sigkill_at_seven_points_then_resume_keeps_every_row_once_and_the_same_table(tmp_path):
    path = tmp_path / "s.csv"
    for k in range(1, 8):  # each run stores at least one more item, then is killed
        pid = _fork_sweep(path, delay=0.2)
        _wait_rows(path, min(5 * k, 40), pid)
        time.sleep(0.02 * k)  # a little later each time, inside the next item (0.2 s)
        _kill(pid)
    resumed = run_sweep(_items(), Rows(), _store(path), verbose=False)
    full = run_sweep(_items(), Rows(), _store(tmp_path / "full.csv"), verbose=False)
    table, want = pd.read_csv(path), pd.read_csv(tmp_path / "full.csv")
    assert len(table) == 40 and not table["x"].duplicated().any()
    pd.testing.assert_frame_equal(table.sort_values("x").reset_index(drop=True), want)
    pd.testing.assert_frame_equal(resumed.rows().sort_values("x").reset_index(drop=True), full.rows())


# --------------------------------------------------------------------------- the strict reader


def _log_with(tmp_path: Path, *extra: bytes) -> Path:
    path = tmp_path / "s.csv"
    run_sweep(_items(1), Rows(), _store(path), verbose=False)
    log = store_paths(path)[0]
    log.write_bytes(log.read_bytes() + b"".join(extra))
    return log


def _line(obj: dict) -> bytes:
    return encode_line(obj)


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        (b"deadbeef {}\n", r"line 7, column 10: the checksum does not match"),
        (b"0000000g {}\n", r"line 7, column 1: not a record line"),
        (b"\n", r"line 7, column 1: an empty line"),
        (b"%08x {bad json}\n" % zlib.crc32(b"{bad json}"), r"line 7, column 11: not valid JSON"),
        (_line({"row": {"x": 9, "y": "abc", "text": "t"}}), r"line 7, column 'y': not a number: 'abc'"),
        (_line({"row": {"x": 9, "y": 1.0}}), r"line 7, column 'text': missing value"),
        (_line({"row": {"x": 9, "y": 1.0, "text": ""}}), r"line 7, column 'text': empty value"),
        (_line({"row": {"x": 9, "y": 1.0, "text": "t", "z": 1}}), r"line 7, column 'z': a column the store"),
        (_line({"row": {"x": float("nan"), "y": 1.0, "text": "t"}}), r"line 7, column 'x': a key value must"),
        (_line({"row": {"x": 0, "y": 1.0, "text": "t0"}}), r"line 7, column 'y': the key \(x=0\) of line 2"),
        (_line({"mechgeom_store": 1}), r"line 7, column 10: the header is not expected here"),
    ],
)
def test_each_malformed_line_is_named_by_file_line_and_column_with_the_repair(tmp_path, extra, where):
    log = _log_with(tmp_path, extra)
    with pytest.raises(StoreCorrupt, match=rf"{log}, {where}.*python -m mechgeom\.sweep repair {log}"):
        _store(tmp_path / "s.csv")


def test_a_damaged_header_cannot_be_repaired_and_says_so(tmp_path):
    log = _log_with(tmp_path)
    data = log.read_bytes()
    log.write_bytes(b"0" + data[1:])
    with pytest.raises(StoreCorrupt, match=rf"{log}, line 1, column 10: .*cannot be repaired.*move it aside"):
        _store(tmp_path / "s.csv")
    with pytest.raises(StoreCorrupt, match="cannot be repaired"):
        repair_log(log)
    log.write_bytes(_line({"mechgeom_store": 99}) + data.split(b"\n", 1)[1])
    with pytest.raises(StoreCorrupt, match="layout 99, but this mechgeom reads layout 1"):
        _store(tmp_path / "s.csv")


def test_repair_moves_the_damaged_lines_aside_and_the_next_run_recomputes_their_rows(tmp_path):
    path = tmp_path / "s.csv"
    run_sweep(_items(), Rows(), _store(path), verbose=False)
    log = store_paths(path)[0]
    lines = log.read_bytes().split(b"\n")
    lines[3] = b"garbage"  # x = 2
    changed = json.loads(lines[5][9:])  # x = 4, stored again with another y
    changed["row"]["y"] += 1.0
    log.write_bytes(b"\n".join([*lines[:-1], _line(changed).rstrip(b"\n"), b""]))
    with pytest.raises(StoreCorrupt, match="line 4, column 1"):
        _store(path)
    assert repair_log(log) == (1 + 40 - 2, 3)
    rejected = Path(f"{log}.rejected").read_bytes()
    assert rejected.startswith(b"garbage\n") and rejected.count(b"\n") == 3
    store = _store(path)
    assert sorted(set(range(40)) - {k[0] for k in store.done}) == [2, 4]
    calls = []
    work = Rows()
    run_sweep(_items(), lambda m, it: calls.append(it.key) or work(m, it), store, verbose=False)
    assert calls == [(0,)]  # only the item of the moved rows runs again
    pd.testing.assert_frame_equal(
        pd.read_csv(path).sort_values("x").reset_index(drop=True),
        run_sweep(_items(), Rows(), _store(tmp_path / "full.csv"), verbose=False).frame,
    )
    cmd = [sys.executable, "-m", "mechgeom.sweep", "show", str(path)]
    shown = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(shown)["rows"] == 40 and json.loads(shown)["key"] == ["x"]


def test_a_torn_last_line_warns_once_and_is_cut_before_the_next_append(tmp_path):
    path = tmp_path / "s.csv"
    run_sweep(_items(2), Rows(), _store(path), verbose=False)
    log = store_paths(path)[0]
    data = log.read_bytes()
    log.write_bytes(data[:-7])  # the last row's line without its end
    with pytest.warns(StoreWarning, match=rf"{log}: its last line \(11\) is incomplete") as caught:
        store = run_sweep(_items(2), Rows(), _store(path), verbose=False)
    assert len(caught) == 1 and len(store.done) == 10
    assert log.read_bytes() == data  # cut, then the same row appended again
    assert parse_log(log, log.read_bytes()).lines == 11


# --------------------------------------------------------------------------- rows, tombstones, the table


def test_discarded_keys_may_be_stored_again_with_another_value(tmp_path):
    path = tmp_path / "s.csv"
    store = _store(path)
    store.add([{"x": 1, "y": 1.0, "text": "a"}, {"x": 2, "y": 4.0, "text": "b"}])
    assert store.discard([(1,), (7,)]) == 1
    store.add([{"x": 1, "y": 9.0, "text": "c"}])
    again = _store(path)
    assert again.rows().to_dict("records") == [
        {"x": 2, "y": 4.0, "text": "b"},
        {"x": 1, "y": 9.0, "text": "c"},
    ]
    assert pd.read_csv(path)["y"].tolist() == [4.0, 9.0]


def test_rows_with_empty_values_or_another_shape_are_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "s.csv"
    store = _store(path)
    with pytest.raises(ValueError, match=r"an empty value in column 'y' \(key \[1\]\)"):
        store.add([{"x": 1, "y": None, "text": "a"}])
    assert not store_paths(path)[0].exists()
    store.add([{"x": 1, "y": 1.0, "text": "a"}])
    with pytest.raises(ValueError, match=r"an empty value in column 'text'"):  # pandas' missing text
        store.add(pd.DataFrame({"x": [4], "y": [1.0], "text": [float("nan")]}))
    with pytest.raises(ValueError, match=r"'b', not of the column's kind \(num\)"):
        store.add([{"x": 2, "y": "b", "text": "a"}])
    with pytest.raises(ValueError, match=r"cannot join sweep store .* whose rows have \['x', 'y', 'text'\]"):
        store.add([{"x": 3, "y": 1.0}])
    assert parse_log(store_paths(path)[0], store_paths(path)[0].read_bytes()).lines == 2


def test_a_table_that_cannot_be_written_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    path = tmp_path / "s.csv"
    run_sweep(_items(1), Rows(), _store(path), verbose=False)
    before = path.read_bytes()

    def half(self, f, **kw):
        f.write("x,y\n1,")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", half)
    with pytest.raises(
        OSError, match=r"could not write the table .*s\.log\.jsonl is intact, rerun to write it"
    ):
        run_sweep(_items(2), Rows(), _store(path), verbose=False)
    assert path.read_bytes() == before and [p.name for p in tmp_path.glob(".*tmp")] == []
    monkeypatch.undo()
    assert len(_store(path).done) == 10  # the second item's rows are in the log
    run_sweep(_items(2), Rows(), _store(path), verbose=False)
    assert len(pd.read_csv(path)) == 10  # and the rerun writes the table


# --------------------------------------------------------------------------- the earlier version's tables


def test_an_earlier_versions_table_is_refused_and_adopted_only_on_request(tmp_path):
    path = tmp_path / "old.csv"
    old = pd.DataFrame({"x": [0, 1, 2], "y": [0.0, 0.5, 2.0], "text": ["t0", "t1", "t2"], "setting_n": 1})
    old.to_csv(path, index=False)
    with pytest.raises(
        ValueError, match=r"written by an earlier mechgeom .*`mv .*old\.csv .*old\.csv\.old`.*adopt"
    ):
        _store(path)
    pd.DataFrame({"x": [0]}).to_csv(tmp_path / "foreign.csv", index=False)
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['setting_n'\]"):
        _store(tmp_path / "foreign.csv")
    request_adoption(path)
    with pytest.raises(ValueError, match=r"other settings \(n: stored 1, now 2\)"):
        _store(path, n=2)
    store = _store(path)
    assert sorted(store.done) == [(0,), (1,), (2,)]
    header = json.loads(store_paths(path)[0].read_bytes().split(b"\n")[0][9:])
    assert "unverified" in header["adopted_from"] and header["fingerprint"] == {"n": "1"}
    assert not (tmp_path / "old.adopt").exists() and len(_store(path).done) == 3
    with pytest.raises(ValueError, match="nothing to adopt"):
        request_adoption(path)
    bad = tmp_path / "bad.csv"
    pd.concat([old, old.iloc[[1]].assign(y=7.0)]).to_csv(bad, index=False)
    request_adoption(bad)
    with pytest.raises(StoreCorrupt, match=rf"{bad}, line 5: the key \(1,\) of line 3 is stored again"):
        _store(bad)


# --------------------------------------------------------------------------- a corpus extended, re-batched


def test_a_larger_corpus_or_another_batch_size_reuses_the_record(tmp_path, monkeypatch):
    model, tokens = make_tiny(), random_tokens(6, 8, seed=3)
    kw = dict(metrics=("attention",), rates=(0.0, 0.5), modes=("comprehensiveness",), n_boot=20)
    passes = []
    real = harness.masked_pass  # (model, work, batch, ranking, rate, mode): one masked forward of a batch
    monkeypatch.setattr(
        harness, "masked_pass", lambda *a, **k: passes.append(len(a[2].tokens)) or real(*a, **k)
    )
    ckpt = tmp_path / "run.csv"
    fa.perplexity_curves(model, tokens[:4], batch_size=2, checkpoint=ckpt, **kw)
    assert sum(passes) == 4
    passes.clear()
    again = fa.perplexity_curves(model, tokens[:4], batch_size=4, checkpoint=ckpt, **kw)  # another batch size
    assert passes == []
    pd.testing.assert_frame_equal(again, fa.perplexity_curves(model, tokens[:4], batch_size=2, **kw))
    passes.clear()
    more = fa.perplexity_curves(model, tokens, batch_size=2, checkpoint=ckpt, **kw)  # two more texts
    assert sum(passes) == 2
    pd.testing.assert_frame_equal(more, fa.perplexity_curves(model, tokens, batch_size=2, **kw))
    passes.clear()
    fa.perplexity_curves(model, tokens[:, :6], batch_size=2, checkpoint=ckpt, **kw)  # shorter windows
    assert sum(passes) == 6  # other texts: computed, and kept beside the others
    assert len(pd.read_csv(tmp_path / "run.per_text.csv")) == (6 + 6) * 2
    with torch.no_grad():  # an edit after loading
        next(iter(model.parameters())).mul_(0.5)
    with pytest.raises(ValueError, match="weights: stored sha256:"):
        fa.perplexity_curves(model, tokens, batch_size=2, checkpoint=ckpt, **kw)
