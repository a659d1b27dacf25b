"""Benchmark: the last query's contribution weights at long contexts (issue 35), on SmolLM2-135M, against a
plain forward.

``contribution_weights(model, tokens, queries=[-1])`` of every layer with the default metrics (7 intra-head +
4 inter-head), the result kept in memory, against a plain forward (``return_type=None``) of the same tokens,
at ``1 x 1024``, ``1 x 4096`` and ``1 x 8192``. Each kind runs in a fresh worker process, so each peak is that
kind's alone (the method of ``bench_contribution.py``: peak resident set size during the run minus the
resident size just before, ``VmHWM`` after resetting it). The result is ``layers * heads * 1 * k`` floats per
intra metric, O(k); the forward itself holds one layer's ``[head, q, k]`` pattern at a time, which both sides
pay. A padded batch against its texts one by one is ``bench_padding.py``.

Time: median of ``--repeats`` runs in the worker after one warm-up (``--repeats 1`` at 4096 and 8192 by
default: a run takes minutes on two cores). Writes a Markdown table to stdout and, with ``--out``, a JSON.

    flock /tmp/heavy.lock python benchmarks/bench_queries.py --threads 2 --out results/contribution/smollm2-135m/queries.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_contribution import measure

LONG = (1024, 4096, 8192)


def _model(threads: int) -> Any:
    import torch

    torch.set_num_threads(threads)
    from mechgeom.models import load_model

    return load_model("smollm2-135m")


def _tokens(model: Any, n: int, seed: int = 0) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, int(model.cfg.d_vocab) - 100, (1, n), generator=g)


def _plain(model: Any, tokens: Any) -> None:
    from mechgeom.hooks import run_hooks

    run_hooks(model, tokens, [])


def _last_query(model: Any, tokens: Any) -> Any:
    from mechgeom import contribution_weights

    return contribution_weights(model, tokens, queries=[-1])


def worker(kind: str, n: int, repeats: int, threads: int) -> dict[str, Any]:
    """One kind in this (fresh) process: its cold run's time and peak, then ``repeats`` timed runs."""
    model = _model(threads)
    tokens = _tokens(model, n)
    fn = (lambda: _plain(model, tokens)) if kind == "plain" else (lambda: _last_query(model, tokens))
    cold_s, peak_mb, _ = measure(fn)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"kind": kind, "n": n, "cold_s": cold_s, "peak_mb": peak_mb, "times": times or [cold_s]}


def spawn(kind: str, n: int, repeats: int, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", kind, "--n", str(n), "--repeats", str(repeats)]
    cmd += ["--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default=",".join(map(str, LONG)))
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the cold one, below 4096 tokens")
    p.add_argument("--out", type=Path)
    p.add_argument("--worker")
    p.add_argument("--n", type=int, default=0)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.repeats, args.threads)))
        return
    rows: list[dict[str, Any]] = []
    print(
        "| shape | plain forward | last-query contributions, all layers | ratio | peak: forward | peak: last query |"
    )
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        reps = args.repeats if n < 4096 else 0
        a, b = spawn("plain", n, reps, args.threads), spawn("last_query", n, reps, args.threads)
        ta, tb = statistics.median(a["times"]), statistics.median(b["times"])
        rows += [a, b]
        print(
            f"| 1x{n} | {ta:.2f} s | {tb:.2f} s | {tb / ta:.3f} | {a['peak_mb']:.0f} MB | {b['peak_mb']:.0f} MB |",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
