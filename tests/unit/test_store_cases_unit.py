"""Issue 34's cases against every sweep that keeps its rows in the sweep store: one parametrised suite.

Each sweep is one entry of ``SWEEPS`` (its call, its store's table, a value column, the inputs it takes, and
what it does with another experiment's record: refuse it, or recompute its entries as the report does). A new
sweep on the store is one more entry. Every case holds on the store of today and failed on the store before
(a table rewritten per row, keyed by a fingerprint of names):

- a record of another experiment is never resumed: other hook code (``z * 0.5`` vs ``z * 0.0``), another
  dtype, weights edited in place, other ``means``;
- a second writer stops at once, naming the store and the holder's PID, and writes nothing;
- a damaged record is read strictly: an empty value, a key stored again with another value and garbage bytes
  are errors naming the file, the line and the column, with the repair; a truncated last line (a crash during
  a write) is dropped with one warning and recomputed;
- a record of the earlier version is never resumed silently, and can be adopted on request;
- a full disk stops the sweep with a clear error and leaves the record intact for a resume.

The tests use only the sweeps' own entry points, the files on disk, and exception and warning base classes, so
they run (and fail) on the earlier code too. The line format they edit is documented in
``mechgeom/sweep/log.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import threading
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens
from sweep_work import encoder_input

from mechgeom import report
from mechgeom.analyses import faithfulness as fa, heads as pruning, scoring as evaluation
from mechgeom.data import TaskItem

ROOT = Path(__file__).resolve().parents[2]
TOKENS = random_tokens(4, 8, seed=2)
ITEMS = [
    TaskItem("boolq", "the sky is blue. is it?", (" no", " yes"), 1),
    TaskItem("mmlu", "pick one:", (" A", " B", " C"), 2),
]
HALF = [("blocks.0.attn.hook_z", lambda z, hook: z * 0.5)]
ZERO = [("blocks.0.attn.hook_z", lambda z, hook: z * 0.0)]


def tiny() -> Any:
    return make_tiny(seed=1)


def tiny_encoder() -> Any:
    return make_tiny(attention_dir="bidirectional", seed=4)


@dataclass(frozen=True)
class Sweep:
    """A sweep on the store: ``run(out, model, hooks, means)`` returns its result as a frame; ``table`` is
    its store's table under ``out``; ``value`` a numeric column of its rows; ``inputs`` what it takes besides
    the model; ``other`` what it does with another experiment's record (``refuse`` or ``recompute``);
    ``appends`` how many times its run appends to the store at least."""

    name: str
    run: Callable[..., pd.DataFrame]
    table: str
    value: str
    inputs: frozenset[str] = frozenset()
    other: str = "refuse"
    appends: int = 2
    make: Callable[[], Any] = tiny  # the model it runs on


def _perplexity(out: Path, model: Any, hooks: Any, means: Any) -> pd.DataFrame:
    return fa.perplexity_curves(
        model, TOKENS, metrics=("attention", "random"), rates=(0.0, 0.5), batch_size=2, n_boot=20,
        extra_hooks=hooks, checkpoint=out / "ppl.csv",
    )  # fmt: skip


def _tasks(out: Path, model: Any, hooks: Any, means: Any) -> pd.DataFrame:
    """The per-choice log-likelihoods the accuracies come from (two items' accuracies hardly move)."""
    fa.task_accuracy_curves(
        model, ITEMS, metrics=("attention", "random"), rates=(0.0, 0.5), batch_size=3, n_boot=20,
        extra_hooks=hooks, checkpoint=out / "t.csv",
    )  # fmt: skip
    rows = pd.read_csv(out / "t.per_choice.csv")[["metric", "mode", "rate", "unit_hash", "logprob"]]
    return rows.sort_values(["metric", "mode", "rate", "unit_hash"]).reset_index(drop=True)


def _embedding(out: Path, model: Any, hooks: Any, means: Any) -> pd.DataFrame:
    """The suite's interventions on hook_v instead of hook_z: where a bridge ignores pattern edits the sweep
    removes sources at hook_z, and refuses extra_hooks there."""
    hooks = [(name.replace("hook_z", "hook_v"), fn) for name, fn in hooks]
    tokens, mask = encoder_input()
    res = fa.embedding_curves(
        model, tokens, attention_mask=mask, metrics=("attention", "random"), rates=(0.0, 0.5), batch_size=2,
        n_boot=20, extra_hooks=hooks, checkpoint=out / "emb.csv",
    )  # fmt: skip
    return res.per_text_frame()


def _single_head(out: Path, model: Any, hooks: Any, means: Any) -> pd.DataFrame:
    mode = "zero" if means is None else "mean"
    res = pruning.single_head_sweep(model, TOKENS, mode=mode, means=means, checkpoint=out / "sh.csv")
    return pd.DataFrame({"nll": res.nll.flatten().numpy()})


def _retention(out: Path, model: Any, hooks: Any, means: Any) -> pd.DataFrame:
    orders = {f"random{s}": pruning.random_order(model, s) for s in range(2)}
    mode = "zero" if means is None else "mean"
    curves = pruning.retention_curves(
        model, orders, {"a": TOKENS}, levels=(1.0, 0.5), mode=mode, means=means, checkpoint=out / "r.csv"
    )
    return curves.to_frame()


def _report(out: Path, model: Any, hooks: Any, means: Any) -> pd.DataFrame:
    res = report.build_report(out, model=model, tokens=TOKENS, stages=["taxonomy"], verbose=False)
    failed = [r.reason for r in res.stages if r.status == "failed"]
    if failed:  # the report logs a failed stage and goes on; here it is the run's error
        raise RuntimeError(failed[0])
    return pd.read_csv(out / "taxonomy.csv")


MODEL, HOOKS, MEANS = "model", "hooks", "means"
SWEEPS = [
    Sweep("perplexity_curves", _perplexity, "ppl.per_text.csv", "logprob", frozenset({MODEL, HOOKS})),
    Sweep("task_accuracy_curves", _tasks, "t.per_choice.csv", "logprob", frozenset({MODEL, HOOKS})),
    Sweep(
        "embedding_curves",
        _embedding,
        "emb.per_text.csv",
        "effect",
        frozenset({MODEL, HOOKS}),
        make=tiny_encoder,
    ),
    Sweep("single_head_sweep", _single_head, "sh.csv", "nll", frozenset({MODEL, MEANS})),
    Sweep("retention_curves", _retention, "r.csv", "ppl", frozenset({MODEL, MEANS})),
    Sweep(
        "report_stages", _report, "stages/stages.csv", "seconds", frozenset({MODEL}), "recompute", appends=1
    ),
]


def taking(*inputs: str) -> list[Any]:
    return [pytest.param(s, id=s.name) for s in SWEEPS if set(inputs) <= s.inputs]


@pytest.fixture(autouse=True)
def _char_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Task items tokenised one character per token (the tiny model has no tokenizer)."""
    monkeypatch.setattr(evaluation, "_encode", lambda _m, text, *, prepend_bos: [ord(c) % 50 for c in text])


def run(sweep: Sweep, out: Path, model: Any = None, hooks: Any = (), means: Any = None) -> pd.DataFrame:
    return sweep.run(out, sweep.make() if model is None else model, list(hooks), means)


def same(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    try:
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-6)
    except AssertionError:
        return False
    return True


def record(sweep: Sweep, out: Path) -> Path:
    """The file that holds the store's rows: its log (``<stem>.log.jsonl``), or the table where there is none
    (the earlier store kept its rows in the table)."""
    table = out / sweep.table
    log = table.with_name(f"{table.stem}.log.jsonl")
    return log if log.exists() else table


def line(obj: dict[str, Any]) -> bytes:
    text = json.dumps(obj, separators=(",", ":")).encode()
    return b"%08x %s" % (zlib.crc32(text), text)


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def other_experiment(
    sweep: Sweep, again: Callable[[], pd.DataFrame], fresh: pd.DataFrame, match: str
) -> None:
    """The rerun on another experiment's record refuses it (naming the difference) or recomputes: it never
    returns the record's numbers."""
    if sweep.other == "refuse":
        with pytest.raises(ValueError, match=match):
            again()
    else:
        assert same(again(), fresh)


# --------------------------------------------------------------------------- another experiment


@pytest.mark.parametrize("sweep", taking(HOOKS))
def test_other_hook_code_is_not_resumed(sweep: Sweep, tmp_path: Path) -> None:
    first = run(sweep, tmp_path / "a", hooks=HALF)
    fresh = run(sweep, tmp_path / "fresh", hooks=ZERO)
    assert not same(first, fresh)  # the two interventions give other numbers
    other_experiment(
        sweep, lambda: run(sweep, tmp_path / "a", hooks=ZERO), fresh, r"extra_hooks: stored .*, now "
    )
    assert same(run(sweep, tmp_path / "a", hooks=HALF), first)  # the same hook code resumes


@pytest.mark.parametrize("sweep", taking(MODEL))
def test_another_dtype_is_not_resumed(sweep: Sweep, tmp_path: Path) -> None:
    first = run(sweep, tmp_path / "a")
    fresh = run(sweep, tmp_path / "fresh", model=sweep.make().to(torch.bfloat16))
    assert not same(first, fresh)
    again = lambda: run(sweep, tmp_path / "a", model=sweep.make().to(torch.bfloat16))  # noqa: E731
    other_experiment(sweep, again, fresh, "dtype: stored float32, now bfloat16")


def zero_w_o(model: Any, layer: int = 0) -> None:
    """Zero layer ``layer``'s ``W_O`` in place (after loading)."""
    with torch.no_grad():
        if hasattr(model, "original_model"):  # a TransformerBridge
            model.original_model.layers[layer].attn.o.weight.zero_()
        else:
            model.blocks[layer].attn.W_O.zero_()


@pytest.mark.parametrize("sweep", taking(MODEL))
def test_weights_edited_in_place_are_not_resumed(sweep: Sweep, tmp_path: Path) -> None:
    model = sweep.make()
    first = run(sweep, tmp_path / "a", model=model)
    zero_w_o(model)
    fresh = run(sweep, tmp_path / "fresh", model=model)
    assert not same(first, fresh)
    other_experiment(sweep, lambda: run(sweep, tmp_path / "a", model=model), fresh, "weights: stored sha256:")


@pytest.mark.parametrize("sweep", taking(MEANS))
def test_other_means_are_not_resumed(sweep: Sweep, tmp_path: Path) -> None:
    cfg = tiny().cfg
    means = torch.randn(cfg.n_layers, cfg.n_heads, cfg.d_head, generator=torch.Generator().manual_seed(0))
    first = run(sweep, tmp_path / "a", means=means)
    fresh = run(sweep, tmp_path / "fresh", means=means * 3)
    assert not same(first, fresh)
    other_experiment(
        sweep, lambda: run(sweep, tmp_path / "a", means=means * 3), fresh, "means: stored tensor"
    )
    assert same(run(sweep, tmp_path / "a", means=means.clone()), first)  # equal content resumes


# --------------------------------------------------------------------------- one writer


@pytest.mark.parametrize("sweep", taking())
def test_a_second_writer_stops_naming_the_holder_and_writes_nothing(
    sweep: Sweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run holds the store (paused in its first ``add``); a second run on the same folder stops
    with an ``OSError`` that names the store and the holder's PID, and leaves every file as it was."""
    import mechgeom.sweep as sweep_pkg

    store_cls = sweep_pkg.RowStore
    real_add = store_cls.add
    paused, go = threading.Event(), threading.Event()
    out, results, errors = tmp_path / "a", [], []

    def add(self: Any, rows: Any) -> int:
        if threading.current_thread().name == "holder":
            paused.set()
            go.wait(60)
        return real_add(self, rows)

    def holder() -> None:
        try:
            results.append(run(sweep, out))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    monkeypatch.setattr(store_cls, "add", add)
    thread = threading.Thread(target=holder, name="holder")
    thread.start()
    try:
        assert paused.wait(60), errors
        before = files(out)
        with pytest.raises(OSError, match=rf"{re.escape(str(out / sweep.table))} .*PID {os.getpid()}"):
            run(sweep, out)
        assert files(out) == before
    finally:
        go.set()
        thread.join(120)
    assert not errors and len(results) == 1
    assert same(run(sweep, out), results[0])  # the first run's record is whole and resumes


# --------------------------------------------------------------------------- a damaged record


def _rows_of(rec: Path) -> list[int]:
    """The indices (0-based) of the record's row lines."""
    lines = rec.read_bytes().split(b"\n")[:-1]
    if rec.suffix == ".csv":
        return list(range(1, len(lines)))
    return [i for i, raw in enumerate(lines) if json.loads(raw[9:]).get("row") is not None]


def change_first_row(
    sweep: Sweep, out: Path, new: Callable[[Any], Any], *, append: bool
) -> tuple[Path, int, int]:
    """Run the sweep, then give the first row of its record the value ``new(value)`` in place, or ``append``
    it changed as a row of its own. Returns the record, the first row's line number and the changed line's."""
    run(sweep, out)
    rec = record(sweep, out)
    first = _rows_of(rec)[0]
    if rec.suffix == ".csv":  # the earlier store: the row in the table (line numbers count its header)
        df = pd.read_csv(rec)
        row = df.iloc[[first - 1]].assign(**{sweep.value: new(df[sweep.value].iloc[first - 1])})
        df = pd.concat([df, row] if append else [df.iloc[: first - 1], row, df.iloc[first:]])
        df.to_csv(rec, index=False)
        return rec, first + 1, len(df) + 1 if append else first + 1
    lines = rec.read_bytes().split(b"\n")[:-1]
    obj = json.loads(lines[first][9:])
    obj["row"][sweep.value] = new(obj["row"][sweep.value])
    lines = [*lines, line(obj)] if append else [*lines[:first], line(obj), *lines[first + 1 :]]
    rec.write_bytes(b"".join(raw + b"\n" for raw in lines))
    return rec, first + 1, len(lines) if append else first + 1


@pytest.mark.parametrize("sweep", taking())
def test_an_empty_value_is_an_error_naming_file_line_and_column(sweep: Sweep, tmp_path: Path) -> None:
    rec, _, n = change_first_row(sweep, tmp_path / "a", lambda v: None, append=False)
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(rec))}, line {n}, column '{sweep.value}': empty value.*repair"
    ):
        run(sweep, tmp_path / "a")


@pytest.mark.parametrize("sweep", taking())
def test_a_key_stored_again_with_another_value_is_an_error(sweep: Sweep, tmp_path: Path) -> None:
    rec, first, n = change_first_row(sweep, tmp_path / "a", lambda v: v + 1, append=True)
    pattern = rf"{re.escape(str(rec))}, line {n}, column '{sweep.value}': the key .* of line {first} is stored again"
    with pytest.raises(ValueError, match=pattern):
        run(sweep, tmp_path / "a")


@pytest.mark.parametrize("sweep", taking())
def test_garbage_bytes_are_an_error_naming_file_line_and_column(sweep: Sweep, tmp_path: Path) -> None:
    out = tmp_path / "a"
    run(sweep, out)
    rec = record(sweep, out)
    lines = rec.read_bytes().split(b"\n")
    rec.write_bytes(b"\n".join([lines[0], b"abc,\x00\xff,1e", *lines[1:]]))
    with pytest.raises(ValueError, match=rf"{re.escape(str(rec))}, line 2, column 1: .*repair"):
        run(sweep, out)


@pytest.mark.parametrize("sweep", taking())
def test_a_truncated_last_line_is_dropped_with_one_warning_and_recomputed(
    sweep: Sweep, tmp_path: Path
) -> None:
    out = tmp_path / "a"
    full = run(sweep, out)
    table = pd.read_csv(out / sweep.table)
    rec = record(sweep, out)
    data = rec.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    rec.write_bytes(data[: start + (len(data) - start) // 2])  # the last line cut in the middle
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = run(sweep, out)
    torn = [w for w in caught if "incomplete" in str(w.message)]
    assert len(torn) == 1 and str(rec) in str(torn[0].message)
    assert same(again, full)
    resumed = pd.read_csv(out / sweep.table)
    assert len(resumed) == len(table) and not resumed.duplicated().any()
    assert rec.read_bytes().endswith(b"\n")


# --------------------------------------------------------------------------- the earlier version, a full disk


@pytest.mark.parametrize("sweep", taking())
def test_a_record_of_the_earlier_version_is_refused_then_adopted_on_request(
    sweep: Sweep, tmp_path: Path
) -> None:
    """A table without its log is what the earlier store left: refused with the two ways out; after
    ``python -m mechgeom.sweep adopt <table>`` the next run takes its rows and gives the same result."""
    out = tmp_path / "a"
    full = run(sweep, out)
    table = out / sweep.table
    log = table.with_name(f"{table.stem}.log.jsonl")
    log.unlink(missing_ok=True)
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(table))} was written by an earlier mechgeom.*adopt"
    ):
        run(sweep, out)
    cmd = [sys.executable, "-m", "mechgeom.sweep", "adopt", str(table)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert same(run(sweep, out), full)
    header = json.loads(log.read_bytes().split(b"\n")[0][9:])
    assert "adopted_from" in header


@pytest.mark.parametrize("sweep", taking())
def test_a_full_disk_stops_with_a_clear_error_and_the_record_resumes(
    sweep: Sweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mechgeom.sweep import store as store_module

    out = tmp_path / "a"
    real, calls = store_module._write_all, []

    def full_disk(fd: int, data: bytes) -> None:
        calls.append(1)
        if len(calls) == sweep.appends:  # the earlier appends fit, half of this one does
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(store_module, "_write_all", full_disk)
    with pytest.raises(
        (OSError, RuntimeError), match=r"No space left on device; the rows stored before are intact"
    ):
        run(sweep, out)
    data = record(sweep, out).read_bytes()
    assert data.count(b"\n") == (sweep.appends > 1) * len(data.split(b"\n")[:-1])  # whole lines only
    assert not data or data.endswith(b"\n")  # the partial line was cut
    monkeypatch.setattr(store_module, "_write_all", real)
    assert same(run(sweep, out), run(sweep, tmp_path / "fresh"))
