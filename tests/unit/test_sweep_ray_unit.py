"""The sweep engine on Ray (mechgeom.sweep.RayExecutor): equality with the local executor, a killed actor,
a driver interrupt and resume, refused fingerprints.

One local Ray cluster (the ``ray_cluster`` fixture of ``conftest.py``) serves the whole test session; it
runs only inside a loopback-only network namespace (``scripts/isolated.sh``, as ``scripts/test.sh`` does).
"""

from __future__ import annotations

import os
import signal
from functools import partial
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens
from sweep_work import TextNLL, encoder_input, items

from mechgeom.analyses import faithfulness
from mechgeom.analyses.heads import pruning
from mechgeom.sweep import (
    LocalExecutor,
    ModelRef,
    RayExecutor,
    RowStore,
    executor_for,
    model_label,
    run_sweep,
)

TINY = ModelRef("tiny", factory="conftest:make_tiny", kwargs=(("seed", 3),))
ENCODER = ModelRef(
    "tiny-encoder", factory="conftest:make_tiny", kwargs=(("attention_dir", "bidirectional"), ("seed", 4))
)


@pytest.fixture(scope="module")
def tiny_ray(ray_cluster):
    """Two actors (``num_cpus=1`` each) on the tiny model, kept for the module's sweeps."""
    with RayExecutor(TINY, workers=2, num_cpus=1) as ex:
        yield ex


def _local_rows(fn, its):
    store = RowStore(None, key=["row"], settings={})
    run_sweep(its, fn, store, executor=LocalExecutor(make_tiny(seed=3)), verbose=False)
    return store.rows().sort_values("row").reset_index(drop=True)


def test_ray_faithfulness_curves_equal_the_local_run_row_for_row(tiny_ray, tmp_path):
    model = make_tiny(seed=3)
    tokens = random_tokens(6, 10, seed=1)
    kw = dict(metrics=("attention", "contribution", "random"), rates=(0.0, 0.3, 0.7), batch_size=2, n_boot=50)
    local = faithfulness.perplexity_curves(model, tokens, **kw)
    ckpt = tmp_path / "ray.csv"
    remote = faithfulness.perplexity_curves(model, tokens, checkpoint=ckpt, executor=tiny_ray, **kw)
    pids = tiny_ray.pids
    pd.testing.assert_frame_equal(local.drop(columns="ppl"), remote.drop(columns="ppl"), rtol=1e-5)
    np.testing.assert_allclose(remote["ppl"], local["ppl"], rtol=1e-5)
    assert (local["delta_ppl"].abs() > 0).any()  # the masks did something
    assert tiny_ray.expect_label == model_label(model) and len(pids) == 2
    record = pd.read_csv(tmp_path / "ray.per_text.csv")
    assert not record.duplicated(["metric", "mode", "rate", "unit_hash"]).any()
    # a second sweep on the same actors (the model loaded once), then a resume with nothing left to run
    other = faithfulness.perplexity_curves(
        model, tokens, executor=tiny_ray, **{**kw, "modes": ("sufficiency",)}
    )
    pd.testing.assert_frame_equal(
        other, faithfulness.perplexity_curves(model, tokens, **{**kw, "modes": ("sufficiency",)}), rtol=1e-5
    )
    assert tiny_ray.pids == pids
    again = faithfulness.perplexity_curves(model, tokens, checkpoint=ckpt, executor=tiny_ray, **kw)
    pd.testing.assert_frame_equal(again, remote)
    with pytest.raises(ValueError, match="seed: stored 0, now 1"):  # refused before any item is sent
        faithfulness.perplexity_curves(model, tokens, checkpoint=ckpt, executor=tiny_ray, **{**kw, "seed": 1})


def test_ray_embedding_curves_equal_the_local_run(ray_cluster, tmp_path):
    """``embedding_curves`` on the sweep engine: on two Ray actors that each build the tiny encoder, the same
    effects as in this process; a rerun resumes from the record with nothing left to run."""
    model = make_tiny(attention_dir="bidirectional", seed=4)
    tokens, mask = encoder_input()
    kw = dict(
        metrics=("attention", "contribution", "random"),
        rates=(0.0, 0.5, 1.0),
        batch_size=2,
        attention_mask=mask,
    )
    local = faithfulness.embedding_curves(model, tokens, **kw)
    ckpt = tmp_path / "ray.csv"
    with RayExecutor(ENCODER, workers=2, num_cpus=1) as ex:
        remote = faithfulness.embedding_curves(model, tokens, checkpoint=ckpt, executor=ex, **kw)
        assert len(set(ex.pids)) == 2
        again = faithfulness.embedding_curves(model, tokens, checkpoint=ckpt, executor=ex, **kw)
    assert (local.effects[:, :, 1:] > 0).all()
    np.testing.assert_allclose(remote.effects, local.effects, rtol=1e-5, atol=1e-7)
    pd.testing.assert_frame_equal(remote.to_frame(), local.to_frame(), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(again.effects, remote.effects)
    record = pd.read_csv(tmp_path / "ray.per_text.csv")
    assert (
        len(record) == (1 + 3 * 2 * 2) * 5
        and not record.duplicated(["metric", "mode", "rate", "unit_hash"]).any()
    )


def test_ray_single_head_sweep_equals_the_local_one(tiny_ray):
    model = make_tiny(seed=3)
    tokens = random_tokens(3, 10, seed=2)
    local = pruning.single_head_sweep(model, tokens)
    remote = pruning.single_head_sweep(model, tokens, executor=tiny_ray)
    np.testing.assert_allclose(remote.nll.numpy(), local.nll.numpy(), rtol=1e-5)
    pd.testing.assert_frame_equal(remote.to_frame(), local.to_frame(), rtol=1e-5)


def test_workers_refuse_a_driver_model_edited_after_loading(tiny_ray):
    """The workers load the model by name; a driver model edited in place would give rows under its own
    weights digest that the workers never computed with: every item is refused."""
    model = make_tiny(seed=3)
    with torch.no_grad():
        next(iter(model.parameters())).mul_(0.5)
    with pytest.raises(ValueError, match=r"the worker's weights \(sha256:\w+\) are not the driver's"):
        pruning.single_head_sweep(model, random_tokens(2, 8, seed=2), executor=tiny_ray)


def test_killed_actors_lose_nothing_and_duplicate_nothing(tiny_ray, tmp_path, ray_cluster):
    fn = TextNLL(random_tokens(12, 12, seed=4), delay=0.2)
    its = items(12)
    seen, restarts = [], tiny_ray.restarts

    def kill_two(item, rows):
        seen.append(item.key)
        if len(seen) == 3:
            ray_cluster.kill(tiny_ray.actors[0])
        if len(seen) == 6:
            os.kill(tiny_ray.pids[1], signal.SIGKILL)

    path = tmp_path / "rows.csv"
    store = run_sweep(its, fn, RowStore(path, key=["row"], settings={}), executor=tiny_ray, on_item=kill_two)
    assert tiny_ray.restarts == restarts + 2
    assert sorted(seen) == sorted(it.key for it in its)  # each item came back exactly once
    on_disk = pd.read_csv(path)
    assert len(on_disk) == 12 and not on_disk["row"].duplicated().any()
    got = store.rows().sort_values("row").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, _local_rows(fn, its), check_dtype=False)


def test_driver_interrupt_leaves_a_store_that_resumes(tiny_ray, tmp_path, ray_cluster):
    fn = TextNLL(random_tokens(8, 12, seed=5))
    its = items(8)
    path = tmp_path / "rows.csv"
    ex = RayExecutor(TINY, workers=2, num_cpus=1)
    done, handles = [], []

    def ctrl_c(item, rows):
        done.append(item.key)
        if len(done) == 3:
            handles.extend(ex.actors)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(its, fn, RowStore(path, key=["row"], settings={"n": 8}), executor=ex, on_item=ctrl_c)
    assert len(handles) == 2 and ex.actors == []
    for actor in handles:  # the actors were killed on the way out
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            ray_cluster.get(actor.process_id.remote(), timeout=30)
    assert len(pd.read_csv(path)) == 3  # every finished item is on disk
    resumed = []
    store = RowStore(path, key=["row"], settings={"n": 8})
    run_sweep(its, fn, store, executor=tiny_ray, on_item=lambda i, r: resumed.append(i.key))
    assert sorted(resumed + done) == sorted(it.key for it in its)  # only the unfinished items ran again
    got = store.rows().sort_values("row").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, _local_rows(fn, its), check_dtype=False)
    with pytest.raises(ValueError, match="n: stored 8, now 9"):
        RowStore(path, key=["row"], settings={"n": 9})


def test_a_worker_that_cannot_load_its_model_fails_once_with_its_error(ray_cluster):
    run = partial(run_sweep, items(2), TextNLL(random_tokens(2, 8)), RowStore(None, key=["row"], settings={}))
    bad = RayExecutor(ModelRef("x", factory="json:no_such_factory"), workers=1)
    with pytest.raises(RuntimeError, match=r"(?s)could not start.*no_such_factory"):
        run(executor=bad)
    # a stand-in 'model' named "b" that imports nothing heavy, so the worker starts in a second or two
    stand_in = SimpleNamespace(model_name="b")
    other = RayExecutor(ModelRef("x", factory="types:SimpleNamespace", kwargs=(("cfg", stand_in),)))
    assert executor_for(make_tiny(), other).expect_label == model_label(make_tiny())
    other.expect_label = "someone-else"
    with pytest.raises(RuntimeError, match=r"(?s)loaded 'b' but the sweep's model is 'someone-else'"):
        run(executor=other)
    assert bad.actors == [] and other.actors == []
    greedy = RayExecutor(TINY, workers=1, num_cpus=64, start_timeout=3)
    with pytest.raises(RuntimeError, match=r"did not start within 3\.0 s"):
        run(executor=greedy)


def test_ray_executor_checks_its_options_and_names_the_extra(monkeypatch):
    with pytest.raises(ValueError, match="workers >= 1"):
        RayExecutor("smollm2-135m", workers=0)
    assert RayExecutor("gemma-3-270m").model == ModelRef("gemma-3-270m")
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    with pytest.raises(ImportError, match=r"mechgeom\[ray\]"):
        list(RayExecutor("smollm2-135m").run(TextNLL(random_tokens(1, 4)), items(1)))
