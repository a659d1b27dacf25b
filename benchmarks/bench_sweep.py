"""Benchmark: the sweep engine on this process against Ray actors, on SmolLM2-135M.

The workload is a small faithfulness sweep (:func:`mechgeom.analyses.faithfulness.perplexity_curves`):
``--n-texts`` WikiText-2 windows x ``--seq-len`` tokens in batches of ``--batch-size``, metrics attention,
contribution and random, rates 0.3 and 0.6, both modes: per batch one clean item (the clean pass and every
ranking) and 12 masked items. Each configuration uses the same number of cores (``--cores``, default 2):

- ``local``: :class:`mechgeom.sweep.LocalExecutor` in this process with ``cores`` torch threads;
- ``ray xA``: A actors with ``cores / A`` torch threads each (``num_cpus`` the same), on a local cluster.

Reported per configuration: the fixed start-up cost (Ray: ``ray.init`` of a local cluster, then the actors
loading the model, measured by :meth:`RayExecutor.start`), the sweep's wall time with the actors up, items
per second, and the table's largest relative PPL difference from the local run (it must be below 1e-5).
Run it in a loopback-only network namespace (a local Ray cluster listens on every interface):

    scripts/isolated.sh .venv/bin/python benchmarks/bench_sweep.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from mechgeom._io import atomic_write
from mechgeom.analyses.faithfulness.curves import perplexity_curves
from mechgeom.data import load_corpus
from mechgeom.models import load_model
from mechgeom.sweep import RayExecutor

METRICS = ("attention", "contribution", "random")
RATES = (0.3, 0.6)


def _sweep(model, tokens, batch_size, executor=None):
    t0 = time.perf_counter()
    frame = perplexity_curves(
        model, tokens, metrics=METRICS, rates=RATES, batch_size=batch_size, n_boot=10, executor=executor
    )
    return frame, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-texts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--actors", default="1,2", help="Ray actor counts to try")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()

    import ray

    model = load_model("smollm2-135m")
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=0)
    n_batches = -(-args.n_texts // args.batch_size)
    n_items = n_batches * (1 + len(METRICS) * 2 * len(RATES))
    torch.set_num_threads(args.cores)
    _sweep(model, tokens[: args.batch_size], args.batch_size)  # warm-up (allocator, kernels)
    ref, t_local = _sweep(model, tokens, args.batch_size)
    rows = [{"engine": "local", "actors": 0, "threads": args.cores, "start_s": 0.0, "sweep_s": t_local}]

    t0 = time.perf_counter()
    ray.init(num_cpus=args.cores, include_dashboard=False, log_to_driver=False)
    t_init = time.perf_counter() - t0
    for n in (int(a) for a in args.actors.split(",")):
        threads = max(1, args.cores // n)
        with RayExecutor("smollm2-135m", workers=n, num_cpus=threads, threads=threads) as ex:
            t0 = time.perf_counter()
            ex.start()
            t_actors = time.perf_counter() - t0
            frame, t = _sweep(model, tokens, args.batch_size, ex)
        diff = float(np.max(np.abs(frame["ppl"] / ref["ppl"] - 1)))
        assert diff < 1e-5, f"Ray x{n} differs from the local run by {diff:.2e} (relative PPL)"
        rows.append({"engine": "ray", "actors": n, "threads": threads, "start_s": t_actors, "sweep_s": t,
                     "max_rel_ppl_diff": diff})  # fmt: skip
    ray.shutdown()

    print(f"workload: {n_items} items ({n_batches} batches x 13), {args.n_texts}x{args.seq_len} tokens, "
          f"{args.cores} cores; ray.init of a local cluster: {t_init:.2f} s")  # fmt: skip
    print("| engine | actors x threads | start-up (actors load the model) | sweep | items/s | vs local |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["items_per_s"] = n_items / r["sweep_s"]
        label = "local" if r["engine"] == "local" else f"ray x{r['actors']}"
        shape = f"1 x {r['threads']}" if r["engine"] == "local" else f"{r['actors']} x {r['threads']}"
        print(f"| {label} | {shape} | {r['start_s']:.1f} s | {r['sweep_s']:.1f} s | {r['items_per_s']:.2f} | "
              f"{t_local / r['sweep_s']:.2f}x |")  # fmt: skip
    if args.json is not None:
        with atomic_write(args.json) as f:
            json.dump({"ray_init_s": t_init, "n_items": n_items, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
