"""The sweep engine (mechgeom.sweep) and the three sweeps that run on it, resumed after a SIGKILL."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens
from sweep_work import encoder_input

from mechgeom.analyses import faithfulness, heads
from mechgeom.analyses.faithfulness import curves as fa, harness
from mechgeom.analyses.heads import pruning
from mechgeom.data import TaskItem
from mechgeom.sweep import Item, LocalExecutor, RowStore, read_store, run_sweep, tokens_hash

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def _square(model, item):
    return [{"x": x, "y": x * x, "by": model} for x in item.data]


def _items(groups=((1, 2), (3,), (4, 5, 6))):
    return [Item(key=(b,), rows=tuple((x,) for x in xs), data=xs) for b, xs in enumerate(groups)]


# --------------------------------------------------------------------------- the store


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_store_round_trip_with_settings_columns(tmp_path, suffix):
    path = tmp_path / f"s{suffix}"
    store = RowStore(path, key=["k", "r"], settings={"model": "m", "seed": 0})
    assert store.done == set() and not path.exists()
    assert store.add([{"k": "a", "r": 0.5, "v": 1.0}, {"k": "b", "r": 0.5, "v": 2.0}]) == 2
    on_disk = pd.read_parquet(path) if suffix == ".parquet" else pd.read_csv(path)
    assert list(on_disk.columns) == ["k", "r", "v", "setting_model", "setting_seed"]
    assert on_disk["setting_model"].tolist() == ["m", "m"] and on_disk["setting_seed"].tolist() == [0, 0]
    again = RowStore(path, key=["k", "r"], settings={"model": "m", "seed": 0})
    assert again.done == {("a", 0.5), ("b", 0.5)}
    assert ("a", 0.5) in again and ("a", 0.25) not in again
    assert again.rows().to_dict("records") == [{"k": "a", "r": 0.5, "v": 1.0}, {"k": "b", "r": 0.5, "v": 2.0}]


def test_store_refuses_other_settings_naming_each_difference(tmp_path):
    path = tmp_path / "s.csv"
    RowStore(path, key=["k"], settings={"model": "m", "seed": 0, "scope": "intra"}).add([{"k": 1}])
    with pytest.raises(ValueError) as err:
        RowStore(path, key=["k"], settings={"model": "m", "seed": 1, "scope": "inter"}, fresh="rm it")
    msg = str(err.value)
    assert "seed: stored 0, now 1" in msg and "scope: stored intra, now inter" in msg
    assert "model" not in msg.split("(", 1)[1]  # only the differing settings are named
    assert "rm it to start a fresh sweep" in msg and str(path) in msg
    # a file without the fingerprint columns (another program's table) is refused too
    pd.DataFrame({"k": [1]}).to_csv(tmp_path / "foreign.csv", index=False)
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['setting_seed'\]"):
        RowStore(tmp_path / "foreign.csv", key=["k"], settings={"seed": 0})
    with pytest.raises(ValueError, match=r"\.csv or \.parquet"):
        RowStore(tmp_path / "x.txt", key=["k"], settings={})


def test_store_never_stores_a_key_twice(tmp_path):
    path = tmp_path / "s.csv"
    store = RowStore(path, key=["k", "r"], settings={})
    assert store.add(pd.DataFrame({"k": ["a", "a", "b"], "r": [0.3, 0.3, 0.3], "v": [1, 2, 3]})) == 2
    # the same keys again, one of them with a float that differs only below 10 decimals
    assert store.add(pd.DataFrame({"k": ["a", "b"], "r": [0.1 + 0.2, 0.3], "v": [9, 9]})) == 0
    assert store.add([{"k": "c", "r": 0.3, "v": 4}]) == 1
    on_disk = pd.read_csv(path)
    assert on_disk[["k", "v"]].values.tolist() == [["a", 1], ["b", 3], ["c", 4]]
    # the table is made from the log: a duplicate key written into the table by hand is never read back
    pd.concat([on_disk, on_disk.iloc[[0]].assign(v=7)]).to_csv(path, index=False)
    assert RowStore(path, key=["k", "r"], settings={}).rows()["v"].tolist() == [1, 3, 4]


# --------------------------------------------------------------------------- the driver and executors


def test_run_sweep_writes_each_item_as_it_finishes_and_resume_skips_finished_items(tmp_path):
    path = tmp_path / "s.csv"
    seen_on_disk = []
    calls = []

    def fn(model, item):
        calls.append(item.key)
        seen_on_disk.append(len(read_store(path)))  # the rows in the store's log, as a watcher reads them
        if item.key == (2,) and len(calls) == 3:
            raise RuntimeError("killed")
        return _square(model, item)

    items = _items()
    with pytest.raises(RuntimeError, match="killed"):
        run_sweep(
            items, fn, RowStore(path, key=["x"], settings={}), executor=LocalExecutor("m"), verbose=False
        )
    assert seen_on_disk == [0, 2, 3]  # every finished item was on disk before the next one started
    calls.clear()
    store = run_sweep(
        items, fn, RowStore(path, key=["x"], settings={}), executor=LocalExecutor("m"), verbose=False
    )
    assert calls == [(2,)]
    full = run_sweep(
        items, _square, RowStore(None, key=["x"], settings={}), executor=LocalExecutor("m"), verbose=False
    )
    pd.testing.assert_frame_equal(store.rows(), full.rows(), check_dtype=False)
    assert store.rows().values.tolist() == [[x, x * x, "m"] for x in range(1, 7)]
    calls.clear()
    run_sweep(items, fn, RowStore(path, key=["x"], settings={}), verbose=False)
    assert calls == []  # nothing left to do


def test_local_executor_runs_items_in_order_and_streams():
    order = []

    def fn(model, item):
        order.append(item.key)
        return _square(model, item)

    stream = LocalExecutor("model").run(fn, _items())
    item, rows = next(stream)
    assert order == [(0,)] and item.key == (0,)  # lazy: the second item has not started
    assert rows.to_dict("records") == [{"x": 1, "y": 1, "by": "model"}, {"x": 2, "y": 4, "by": "model"}]
    assert [i.key for i, _ in stream] == [(1,), (2,)] and order == [(0,), (1,), (2,)]


def test_run_sweep_accepts_any_completion_order_and_checks_items():
    class Reversed:
        def run(self, fn, items):
            results = [(item, pd.DataFrame(fn(None, item))) for item in items]
            yield from reversed(results)

    store = run_sweep(
        _items(), _square, RowStore(None, key=["x"], settings={}), executor=Reversed(), verbose=False
    )
    assert sorted(store.rows()["x"]) == [1, 2, 3, 4, 5, 6] and len(store.rows()) == 6
    with pytest.raises(ValueError, match="share the key"):
        run_sweep([*_items(), Item(key=(0,))], _square, RowStore(None, key=["x"], settings={}), verbose=False)
    short = [Item(key=(0,), rows=((1,), (2,)), data=(1,))]  # declares a row it never returns
    with pytest.raises(ValueError, match=r"returned no rows for 1 key\(s\) \[\(2,\)\]"):
        run_sweep(short, _square, RowStore(None, key=["x"], settings={}), verbose=False)


def test_items_and_work_functions_pickle_without_their_caches():
    item = Item(key=("a", 0.5, 1), rows=(("a", 0.5, "u1"),), batch=(0, 1), data=("a",))
    assert pickle.loads(pickle.dumps(item)) == item
    model = make_tiny()
    units = harness.Units.prefixes(
        random_tokens(2, 6), [6, 6], ["u1", "u2"], targets=torch.ones(2, 5, dtype=torch.bool)
    )
    work = harness.MaskingWork(units, fa.TargetLogprob(), [0, 1], "intra", 0)
    rows = work(model, Item(key=("clean", "clean", 0.0, 0), batch=(0, 1), data=("attention",)))
    assert work._cache and rows["unit_hash"].tolist() == ["u1", "u2"]
    clone = pickle.loads(pickle.dumps(work))
    assert clone._cache == {} and torch.equal(clone.units.tokens, units.tokens)
    pd.testing.assert_frame_equal(
        clone(model, Item(key=("clean", "clean", 0.0, 0), batch=(0, 1), data=())), rows
    )
    from mechgeom.models import is_bridge

    # the start_at_layer path exists on a HookedTransformer only (single_head_sweep picks it the same way)
    head = pruning._HeadWork(random_tokens(2, 6), "zero", None, 8, not is_bridge(model))
    head(model, Item(key=(1, 0)))
    assert pickle.loads(pickle.dumps(head))._cache == {}
    assert tokens_hash(random_tokens(2, 6)) != tokens_hash(random_tokens(2, 6, seed=1))


# --------------------------------------------------------------------------- retention checkpoint identity


def test_retention_checkpoint_from_another_run_is_refused(tmp_path):
    model = make_tiny(n_layers=2, seed=5)
    corpora = {"a": random_tokens(2, 8, seed=1)}
    orders = {"random": heads.random_order(model, 0)}
    ckpt = tmp_path / "curves.csv"
    first = pruning.retention_curves(model, orders, corpora, levels=(1.0, 0.5), checkpoint=ckpt)
    on_disk = pd.read_csv(ckpt)
    assert len(on_disk) == 2 and {"setting_corpora", "setting_levels"} <= set(on_disk.columns)
    # another corpus under the same name and the same head count: refused, not reused
    with pytest.raises(ValueError, match=r"checkpoint .* other settings \(corpora: stored a=.*, now a="):
        pruning.retention_curves(
            model, orders, {"a": random_tokens(2, 8, seed=2)}, levels=(1.0, 0.5), checkpoint=ckpt
        )
    with pytest.raises(ValueError, match=r"levels: stored 1\.0,0\.5, now 1\.0,0\.5,0\.2"):
        pruning.retention_curves(model, orders, corpora, levels=(1.0, 0.5, 0.2), checkpoint=ckpt)
    with pytest.raises(ValueError, match="mode: stored zero, now mean"):
        means = heads.head_stats(model, random_tokens(2, 8, seed=3))
        pruning.retention_curves(
            model, orders, corpora, levels=(1.0, 0.5), mode="mean", means=means, checkpoint=ckpt
        )
    task = ("t", [TaskItem("t", "a b", (" c", " d"), 0)])
    with pytest.raises(ValueError, match="task: stored none, now t="):
        pruning.retention_curves(model, orders, corpora, levels=(1.0, 0.5), task=task, checkpoint=ckpt)
    with pytest.raises(ValueError, match="heads: stored 2x4, now 3x4"):
        other = make_tiny(n_layers=3, seed=5)
        pruning.retention_curves(
            other, {"random": heads.random_order(other, 0)}, corpora, levels=(1.0, 0.5), checkpoint=ckpt
        )
    with pytest.raises(ValueError, match="delete it or choose another checkpoint="):
        pruning.retention_curves(model, orders, corpora, levels=(0.5,), checkpoint=ckpt)
    # the file is unchanged by the refused runs, and the same run still resumes from it
    pd.testing.assert_frame_equal(pd.read_csv(ckpt), on_disk)
    again = pruning.retention_curves(model, orders, corpora, levels=(1.0, 0.5), checkpoint=ckpt)
    pd.testing.assert_frame_equal(again.to_frame(), first.to_frame(), check_dtype=False)


def test_single_head_checkpoint_refuses_another_model_or_mode(tmp_path):
    toks = random_tokens(2, 8, seed=1)
    ckpt = tmp_path / "sweep.csv"
    pruning.single_head_sweep(make_tiny(n_layers=1, seed=3), toks, heads=[(0, 0)], checkpoint=ckpt)
    with pytest.raises(ValueError, match="heads: stored 1x4, now 2x4"):
        pruning.single_head_sweep(make_tiny(n_layers=2, seed=3), toks, checkpoint=ckpt)
    means = heads.head_stats(make_tiny(n_layers=1, seed=3), toks)
    with pytest.raises(ValueError, match="mode: stored zero, now mean"):
        pruning.single_head_sweep(
            make_tiny(n_layers=1, seed=3), toks, mode="mean", means=means, checkpoint=ckpt
        )


# --------------------------------------------------------------------------- SIGKILL, then resume


def _kill_when(script: str, path: Path, enough, timeout: float = 120.0) -> None:
    """Run ``script`` in a subprocess; SIGKILL it once the store at ``path`` satisfies ``enough(frame)``."""
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + textwrap.dedent(script)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = path.with_suffix(".stderr")
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=err)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = read_store(path)  # the rows appended to the store's log so far
            if len(rows) and enough(rows):
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                assert proc.returncode == -signal.SIGKILL, "the sweep finished before it was killed"
                return
            if proc.poll() is not None:
                pytest.fail(f"the sweep exited with {proc.returncode}: {log.read_text()[-2000:]}")
            time.sleep(0.02)
        pytest.fail("the sweep wrote too few rows in time")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _same_rows(a: pd.DataFrame, b: pd.DataFrame, key: list[str]) -> None:
    assert not a.duplicated(key).any() and not b.duplicated(key).any()
    a, b = (f.sort_values(key, kind="mergesort").reset_index(drop=True) for f in (a, b))
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-6, atol=1e-7)


def test_faithfulness_resumes_after_sigkill(tmp_path):
    kw = dict(metrics=("attention", "random"), rates=(0.5, 1.0), batch_size=2, verbose=False)
    script = f"""
        import time
        from conftest import make_tiny, random_tokens
        from mechgeom.analyses.faithfulness import curves as fa, harness
        real = harness.masked_pass
        harness.masked_pass = lambda *a, **k: (time.sleep(0.25), real(*a, **k))[1]
        fa.perplexity_curves(make_tiny(), random_tokens(5, 8, seed=2), checkpoint={str(tmp_path / "run.csv")!r}, **{kw!r})
    """
    record = tmp_path / "run.per_text.csv"
    _kill_when(script, record, lambda f: (f["metric"] != "clean").sum() >= 4)
    killed = read_store(record)
    assert not (tmp_path / "run.csv").exists()
    model, tokens = make_tiny(), random_tokens(5, 8, seed=2)
    full = faithfulness.perplexity_curves(model, tokens, checkpoint=tmp_path / "full.csv", **kw)
    full_record = pd.read_csv(tmp_path / "full.per_text.csv")
    assert len(killed) < len(full_record)  # it was interrupted mid-way
    resumed = faithfulness.perplexity_curves(model, tokens, checkpoint=tmp_path / "run.csv", **kw)
    pd.testing.assert_frame_equal(resumed, full)
    _same_rows(pd.read_csv(record), full_record, ["metric", "mode", "rate", "unit_hash"])


def test_embedding_curves_resume_after_sigkill(tmp_path):
    """``embedding_curves`` on the sweep engine: killed mid-sweep, then rerun, it gives the table of an
    uninterrupted run, and its record holds every (metric, mode, rate, text) once."""
    kw = dict(metrics=("attention", "random"), rates=(0.0, 0.5, 1.0), batch_size=2, verbose=False)
    script = f"""
        import time
        from conftest import make_tiny
        from sweep_work import encoder_input
        from mechgeom.analyses.faithfulness import embedding, harness
        real = harness.masked_pass
        harness.masked_pass = lambda *a, **k: (time.sleep(0.25), real(*a, **k))[1]
        tokens, mask = encoder_input()
        model = make_tiny(attention_dir="bidirectional", seed=4)
        embedding.embedding_curves(model, tokens, attention_mask=mask, checkpoint={str(tmp_path / "run.csv")!r}, **{kw!r})
    """
    record = tmp_path / "run.per_text.csv"
    _kill_when(script, record, lambda f: (f["metric"] != "clean").sum() >= 4)
    killed = read_store(record)
    assert not (tmp_path / "run.csv").exists()
    model = make_tiny(attention_dir="bidirectional", seed=4)
    tokens, mask = encoder_input()
    full = faithfulness.embedding_curves(
        model, tokens, attention_mask=mask, checkpoint=tmp_path / "full.csv", **kw
    )
    full_record = pd.read_csv(tmp_path / "full.per_text.csv")
    assert len(killed) < len(full_record) == (1 + 2 * 2 * 2) * 5  # interrupted mid-way
    resumed = faithfulness.embedding_curves(
        model, tokens, attention_mask=mask, checkpoint=tmp_path / "run.csv", **kw
    )
    np.testing.assert_allclose(resumed.effects, full.effects, rtol=1e-6, atol=1e-7)
    assert (full.effects[:, :, 1:] > 0).all() and resumed.unit_hashes == full.unit_hashes
    pd.testing.assert_frame_equal(resumed.to_frame(), full.to_frame(), rtol=1e-6, atol=1e-7)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "run.csv"), pd.read_csv(tmp_path / "full.csv"))
    _same_rows(pd.read_csv(record), full_record, ["metric", "mode", "rate", "unit_hash"])
    with pytest.raises(ValueError, match="seed: stored 0, now 1"):
        faithfulness.embedding_curves(
            model, tokens, attention_mask=mask, checkpoint=tmp_path / "run.csv", **{**kw, "seed": 1}
        )


def test_single_head_sweep_resumes_after_sigkill(tmp_path):
    script = f"""
        import time
        from conftest import make_tiny, random_tokens
        from mechgeom.analyses.heads import pruning
        real = pruning._nll_from_layer
        pruning._nll_from_layer = lambda *a, **k: (time.sleep(0.2), real(*a, **k))[1]
        model = make_tiny(n_layers=3, seed=3)
        pruning.single_head_sweep(model, random_tokens(3, 8, seed=1), batch_size=2, checkpoint={str(tmp_path / "s.csv")!r})
    """
    ckpt = tmp_path / "s.csv"
    _kill_when(script, ckpt, lambda f: len(f) >= 3 * 3)  # three heads done
    killed = read_store(ckpt)
    model, toks = make_tiny(n_layers=3, seed=3), random_tokens(3, 8, seed=1)
    full = pruning.single_head_sweep(model, toks, batch_size=2, checkpoint=tmp_path / "full.csv")
    assert len(killed) < 12 * 3
    resumed = pruning.single_head_sweep(model, toks, batch_size=2, checkpoint=ckpt)
    torch.testing.assert_close(resumed.nll, full.nll, atol=1e-6, rtol=1e-6)
    assert not torch.isnan(resumed.nll).any()
    _same_rows(pd.read_csv(ckpt), pd.read_csv(tmp_path / "full.csv"), ["layer", "head", "text"])


def test_retention_curves_resume_after_sigkill(tmp_path):
    script = f"""
        import time
        from conftest import make_tiny, random_tokens
        from mechgeom.analyses import heads
        from mechgeom.analyses.heads import pruning
        real = pruning.retention_curve
        pruning.retention_curve = lambda *a, **k: (time.sleep(0.4), real(*a, **k))[1]
        model = make_tiny(n_layers=2, seed=5)
        orders = {{f"random{{s}}": heads.random_order(model, s) for s in range(5)}}
        corpora = {{"a": random_tokens(2, 8, seed=1), "b": random_tokens(2, 6, seed=2)}}
        pruning.retention_curves(model, orders, corpora, levels=(1.0, 0.5, 0.25), checkpoint={str(tmp_path / "r.csv")!r})
    """
    ckpt = tmp_path / "r.csv"
    _kill_when(script, ckpt, lambda f: f["order"].nunique() >= 2)
    killed = read_store(ckpt)
    model = make_tiny(n_layers=2, seed=5)
    orders = {f"random{s}": heads.random_order(model, s) for s in range(5)}
    corpora = {"a": random_tokens(2, 8, seed=1), "b": random_tokens(2, 6, seed=2)}
    kw = dict(levels=(1.0, 0.5, 0.25))
    full = pruning.retention_curves(model, orders, corpora, checkpoint=tmp_path / "full.csv", **kw)
    assert len(killed) < len(full.frame) == 5 * 3 * 2
    resumed = pruning.retention_curves(model, orders, corpora, checkpoint=ckpt, **kw)
    pd.testing.assert_frame_equal(resumed.to_frame(), full.to_frame(), check_exact=False, rtol=1e-6)
    _same_rows(pd.read_csv(ckpt), pd.read_csv(tmp_path / "full.csv"), ["order", "retention", "corpus"])


def test_faithfulness_items_share_one_clean_pass_per_batch_and_aliased_masked_passes(monkeypatch):
    model, tokens = make_tiny(), random_tokens(5, 8, seed=2)
    kw = dict(rates=(0.0, 0.5, 1.0), batch_size=2, n_boot=50, verbose=False)
    calls = {"clean": 0, "masked": 0}
    real_clean, real_masked = harness.clean_pass, harness.masked_pass

    def clean(*a, **k):
        calls["clean"] += 1
        return real_clean(*a, **k)

    def masked(*a, **k):
        calls["masked"] += 1
        return real_masked(*a, **k)

    monkeypatch.setattr(harness, "clean_pass", clean)
    monkeypatch.setattr(harness, "masked_pass", masked)
    both = faithfulness.perplexity_curves(
        model, tokens, ["value_weighted", "value_weighted_normalized"], **kw
    )
    # 3 batches: one clean pass each; the two metrics rank alike, so 2 modes x 2 rates passes per batch
    assert calls == {"clean": 3, "masked": 3 * 2 * 2}
    alone = faithfulness.perplexity_curves(model, tokens, ["value_weighted_normalized"], **kw)
    shared = both[both["metric"] == "value_weighted_normalized"].reset_index(drop=True)
    pd.testing.assert_frame_equal(shared, alone)


def test_ray_executor_close_waits_until_each_killed_actor_is_dead():
    """``ray.kill`` only asks: a call sent just after it may still be served. close() returns once Ray
    answers that each actor died (a fake Ray whose actors serve two more calls after their kill), and gives
    up on an actor that never answers after ``wait`` seconds."""
    from mechgeom.sweep import RayExecutor

    class ActorDied(Exception):
        pass

    class Timeout(Exception):
        pass

    class Actor:
        def __init__(self, grace):
            self.killed, self.grace, self.calls = False, grace, 0
            self.process_id = SimpleNamespace(remote=self.call)

        def call(self):
            self.calls += 1
            if self.killed and self.grace == 0:
                return ActorDied()
            if self.killed and self.grace is not None:
                self.grace -= 1
            return 123 if self.grace is not None else Timeout()

    def get(ref, timeout):
        if isinstance(ref, Exception):
            raise ref
        return ref

    fake = SimpleNamespace(
        kill=lambda a: setattr(a, "killed", True),
        get=get,
        exceptions=SimpleNamespace(RayActorError=ActorDied, GetTimeoutError=Timeout),
    )
    ex = RayExecutor("smollm2-135m", workers=2)
    ex._ray, ex.actors = fake, [Actor(2), Actor(3)]
    actors = list(ex.actors)
    ex.close()
    assert ex.actors == [] and all(a.killed and a.grace == 0 for a in actors)
    assert [a.calls for a in actors] == [3, 4]  # served twice (three times) after the kill, then dead
    hung = Actor(None)  # never answers: one call, timed out, and close() returns
    ex._ray, ex.actors = fake, [hung]
    ex.close(wait=0.5)
    assert hung.killed and hung.calls == 1 and ex.actors == []
