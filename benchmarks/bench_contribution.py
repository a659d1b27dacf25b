"""Benchmark: contribution weights (SPEC.md §A) on SmolLM2-135M, against a plain cache and a naive reference.

For each input shape (batch x tokens) it measures, side by side in one process (``--isolate``: each in a
fresh worker process instead):

(a) ``run_with_cache`` of the activations the metrics need (``hook_pattern``, ``hook_v``, ``hook_z`` of all
    30 layers, ``names_filter``), ``return_type=None``: the forward pass a user pays to get the inputs.
(b) mechgeom: one forward pass with :class:`ContributionCollector` hooks computing the whole metric family
    (7 intra-head + 4 inter-head metrics) for all 30 layers, streamed to an ``on_layer`` callback that drops
    each layer's tensors after they are computed (PyTorch is eager: every metric is fully materialised as a
    ``[batch, head, q, k]`` / ``[batch, q, k]`` tensor before the callback sees it). What a consumer then
    does with them (write, reduce, rank) is its own cost, excluded from (b) and (c) alike. Memory stays at
    one layer of results.
(b') the same with ``reuse_buffers=True``: every layer's metrics are written into the same output tensors,
    so no fresh memory (page faults) per layer; the callback must copy what it keeps.
(c) naive: the same forward as (a), then for every layer and head ``alpha[h,i,j] * vt[j,h]`` materialised as
    a ``[q, k, d_model]`` tensor (in query chunks of at most ``--chunk-mb``) and every metric read off it
    with norms and inner products. When the projected time exceeds ``--naive-budget`` seconds, only the
    first layers are run and the time is extrapolated linearly to all 30 (every layer costs the same); the
    table says so.

Time: median of ``--repeats`` runs after one warm-up run ((c): one run); in one process the rounds are
interleaved (a, b, b', a, b, b', ...). Memory, always from a fresh worker process per kind (inside one
process the allocator keeps pages an earlier measurement touched): peak resident set size of the worker
during its first run minus its resident size just before (Linux ``/proc/self/status`` ``VmHWM`` after
resetting it through ``/proc/self/clear_refs``): everything the process touches, torch tensors included, on
top of the loaded model and the input tokens.

    flock /tmp/heavy.lock python benchmarks/bench_contribution.py --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES = "1x128,1x512,1x1024,4x512"
NEEDED = ("attn.hook_pattern", "attn.hook_v", "attn.hook_z")


# --------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(seconds, peak RSS growth in MB, result) of one call."""
    import gc

    gc.collect()
    rss0 = _status_kb("VmRSS")
    if not _reset_peak():  # fall back to the lifetime peak (ru_maxrss) if the kernel refuses
        import resource

        rss0 = max(rss0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    return dt, max(0, peak - rss0) / 1024, out


# --------------------------------------------------------------------------- the three measurements


def run_cache(model: Any, tokens: Any) -> Any:
    import torch

    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(NEEDED), return_type=None)
    return cache


def run_mechgeom(model: Any, tokens: Any, reuse_buffers: bool = False) -> int:
    from mechgeom.analyses.contribution import ContributionCollector
    from mechgeom.hooks import run_hooks

    seen: list[int] = []

    def drop(layer: int, metrics: dict) -> None:
        # every tensor is computed by now; a streaming consumer would write or reduce it here
        seen.append(layer)

    # all layers, all intra and inter metrics
    col = ContributionCollector(model, on_layer=drop, reuse_buffers=reuse_buffers)
    run_hooks(model, tokens, col.fwd_hooks)
    assert len(seen) == model.cfg.n_layers
    return len(seen)


def naive_layer(alpha: Any, v_kv: Any, W_O: Any, chunk_mb: float) -> dict[str, float]:
    """Every §A metric of one layer from ``alpha * vt`` materialised as ``[q, k, d_model]`` per head."""
    import torch

    B, H, Q, K = alpha.shape
    group = H // v_kv.shape[2]
    m = W_O.shape[-1]
    qc = max(1, min(Q, int(chunk_mb * 2**20 // (K * m * 4))))
    checksum = 0.0
    for b in range(B):
        vts = [v_kv[b, :, h // group] @ W_O[h] for h in range(H)]  # [k, m] each
        for q0 in range(0, Q, qc):
            qs = slice(q0, min(q0 + qc, Q))
            T_layer = None
            for h in range(H):
                T = alpha[b, h, qs, :, None] * vts[h][None]  # [qc, k, m], materialised
                o_h = T.sum(1)  # [qc, m]
                on = o_h.norm(dim=-1)
                vw = T.norm(dim=-1)  # value-weighted
                vwn = vw / on[:, None]
                dot = torch.einsum("qkm,qm->qk", T, o_h)
                c = dot / (on**2)[:, None]  # contribution
                ratio = vts[h].norm(dim=-1)[None] / on[:, None]
                cos = (o_h @ vts[h].T) / (on[:, None] * vts[h].norm(dim=-1)[None])
                checksum += float(c.nansum() + vwn.nansum() + ratio.nansum() + cos.nansum())
                T_layer = T if T_layer is None else T_layer.add_(T)
                del T
            assert T_layer is not None
            o = T_layer.sum(1)
            onl = o.norm(dim=-1)
            vw_i = T_layer.norm(dim=-1)
            c_i = torch.einsum("qkm,qm->qk", T_layer, o) / (onl**2)[:, None]
            checksum += float(vw_i.nansum() + (vw_i / onl[:, None]).nansum() + c_i.nansum())
            checksum += float(alpha[b, :, qs].mean(0).sum())
            del T_layer
            for h in range(H):  # head shares need the layer output: a second pass over the heads
                T = alpha[b, h, qs, :, None] * vts[h][None]
                share = torch.einsum("qkm,qm->qk", T, o) / (onl**2)[:, None]
                checksum += float(share.nansum())
                del T
    return {"checksum": checksum}


def run_naive(model: Any, tokens: Any, budget_s: float, chunk_mb: float) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    cache = run_cache(model, tokens)
    t_fwd = time.perf_counter() - t0
    n_layers = model.cfg.n_layers
    t1 = time.perf_counter()
    done = 0
    with torch.no_grad():
        for layer in range(n_layers):
            p = f"blocks.{layer}.attn."
            naive_layer(cache[p + "hook_pattern"], cache[p + "hook_v"], model.W_O[layer].detach(), chunk_mb)
            done += 1
            elapsed = time.perf_counter() - t1
            if elapsed / done * n_layers > budget_s and done < n_layers:
                break
    t_metrics = time.perf_counter() - t1
    return {
        "forward_s": t_fwd,
        "layers_run": done,
        "metrics_s_measured": t_metrics,
        "total_s": t_fwd + t_metrics / done * n_layers,
    }


# --------------------------------------------------------------------------- worker and driver


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from mechgeom import load_model
    from mechgeom.data import load_corpus

    model = load_model(args.model)
    tokens = load_corpus("wikitext2", model, n_texts=args.batch, seq_len=args.seq, seed=0)
    out: dict[str, Any] = {"kind": args.worker, "batch": args.batch, "seq": args.seq}
    if args.worker == "naive":
        dt, mb, info = measure(lambda: run_naive(model, tokens, args.naive_budget, args.chunk_mb))
        out.update(info, peak_mb=mb, times=[info["total_s"]])
    else:
        fns = {
            "cache": lambda: run_cache(model, tokens),
            "mechgeom": lambda: run_mechgeom(model, tokens),
            "reuse": lambda: run_mechgeom(model, tokens, reuse_buffers=True),
        }
        fn = fns[args.worker]
        _, mb, res = measure(fn)  # first (cold) run: memory; also the warm-up
        del res
        times = []
        for _ in range(args.repeats):
            dt, _, res = measure(fn)
            del res
            times.append(dt)
        out.update(peak_mb=mb, times=times)
    print("RESULT " + json.dumps(out), flush=True)


def in_process(model: Any, batch: int, seq: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Times of all four measurements of one shape side by side in this process: one warm-up run of each of
    (a), (b), (b'), then ``--repeats`` interleaved rounds (a, b, b', a, b, b', ...) so that any outside load
    hits them alike, then (c) once. Peak memory cannot be told apart inside one process (the allocator keeps
    pages that an earlier measurement touched), so each kind's peak comes from one cold run in a fresh worker
    (``--repeats 0``; (c): its first layer, which peaks like every other)."""
    from mechgeom.data import load_corpus

    tokens = load_corpus("wikitext2", model, n_texts=batch, seq_len=seq, seed=0)
    fns = {
        "cache": lambda: run_cache(model, tokens),
        "mechgeom": lambda: run_mechgeom(model, tokens),
        "reuse": lambda: run_mechgeom(model, tokens, reuse_buffers=True),
    }
    res: dict[str, dict[str, Any]] = {kind: {"times": []} for kind in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for kind, fn in fns.items():
            dt, _, out = measure(fn)
            del out
            res[kind]["times"].append(dt)
    info = run_naive(model, tokens, args.naive_budget, args.chunk_mb)
    res["naive"] = {**info, "times": [info["total_s"]]}
    for kind in res:
        res[kind]["peak_mb"] = spawn(kind, batch, seq, args, memory_only=True)["peak_mb"]
    return res


def spawn(
    kind: str, batch: int, seq: int, args: argparse.Namespace, *, memory_only: bool = False
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--threads",
        str(args.threads),
        "--repeats",
        "0" if memory_only else str(args.repeats),
        "--naive-budget",
        "0" if memory_only else str(args.naive_budget),
        "--chunk-mb",
        str(args.chunk_mb),
        "--model",
        args.model,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    if args.thp:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"worker {kind} {batch}x{seq} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def fmt_s(x: float) -> str:
    return f"{x:.2f} s" if x < 100 else f"{x:.0f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated BATCHxTOKENS")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--naive-budget", type=float, default=120.0, help="seconds before (c) extrapolates")
    ap.add_argument("--chunk-mb", type=float, default=256.0, help="largest [q,k,d_model] chunk of (c)")
    ap.add_argument(
        "--thp",
        action="store_true",
        help="set THP_MEM_ALLOC_ENABLE=1 in the workers (PyTorch backs large CPU tensors by huge pages: "
        "fewer page faults for every measurement)",
    )
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="run each measurement in its own worker process (default: all side by side in this process)",
    )
    ap.add_argument("--out", default="results/contribution/smollm2-135m/benchmark.md")
    ap.add_argument("--worker", choices=["cache", "mechgeom", "reuse", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    if args.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read when torch starts
    import torch

    model = None
    if not args.isolate:
        torch.set_num_threads(args.threads)
        from mechgeom import load_model

        model = load_model(args.model)
    rows = []
    for shape in args.shapes.split(","):
        batch, seq = (int(x) for x in shape.lower().split("x"))
        if model is None:
            res = {kind: spawn(kind, batch, seq, args) for kind in ("cache", "mechgeom", "reuse", "naive")}
        else:
            res = in_process(model, batch, seq, args)
        ta = statistics.median(res["cache"]["times"])
        tb = statistics.median(res["mechgeom"]["times"])
        tr = statistics.median(res["reuse"]["times"])
        tc = res["naive"]["total_s"]
        n_run = res["naive"]["layers_run"]
        note = "" if n_run == 30 else f" (extrapolated from {n_run}/30 layers)"
        rows.append(
            {
                "shape": f"{batch}×{seq}",
                "a": ta,
                "b": tb,
                "r": tr,
                "c": tc,
                "c_note": note,
                "b/a": tb / ta,
                "r/a": tr / ta,
                "c/b": tc / tb,
                "mem_a": res["cache"]["peak_mb"],
                "mem_b": res["mechgeom"]["peak_mb"],
                "mem_r": res["reuse"]["peak_mb"],
                "mem_c": res["naive"]["peak_mb"],
                "times_a": res["cache"]["times"],
                "times_b": res["mechgeom"]["times"],
            }
        )
        print(
            f"{batch}x{seq}: a={ta:.2f}s b={tb:.2f}s b'={tr:.2f}s c={tc:.1f}s{note}  b/a={tb / ta:.2f} "
            f"b'/a={tr / ta:.2f} c/b={tc / tb:.1f}  peak MB a={rows[-1]['mem_a']:.0f} b={rows[-1]['mem_b']:.0f} "
            f"b'={rows[-1]['mem_r']:.0f} c={rows[-1]['mem_c']:.0f}",
            flush=True,
        )

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    lines = [
        f"Contribution weights on {args.model}, all 30 layers, CPU ({cpu}), {args.threads} threads, "
        f"torch {torch.__version__}{', THP_MEM_ALLOC_ENABLE=1' if args.thp else ''}; "
        f"{'each measurement in its own worker process' if args.isolate else 'side by side in one process'}; "
        f"median of {args.repeats} runs after a warm-up ((c): one run).",
        "",
        "| batch × tokens | (a) run_with_cache | (b) mechgeom, full family | (b′) same, reuse_buffers "
        "| (c) naive `[q,k,d_model]` | b/a | b′/a | c/b | peak mem (a) | peak mem (b) | peak mem (b′) "
        "| peak mem (c) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {fmt_s(r['a'])} | {fmt_s(r['b'])} | {fmt_s(r['r'])} | {fmt_s(r['c'])}{r['c_note']} "
            f"| {r['b/a']:.2f} | {r['r/a']:.2f} | {r['c/b']:.1f} | {r['mem_a']:.0f} MB | {r['mem_b']:.0f} MB "
            f"| {r['mem_r']:.0f} MB | {r['mem_c']:.0f} MB |"
        )
    lines += [
        "",
        "(a) forward pass caching hook_pattern/hook_v/hook_z of every layer (`return_type=None`); (b) one "
        "forward pass with the collector computing all 7 intra-head and 4 inter-head metrics of every layer, "
        "streamed to a callback that drops them (so memory holds one layer of results); (b′) the same with "
        "`reuse_buffers=True`: every layer is written into the same output tensors (no fresh pages per layer); "
        "(c) the forward of (a) plus, per layer and head, `alpha * vt` materialised as `[q, k, d_model]` (query chunks of at most "
        f"{args.chunk_mb:.0f} MB) with every metric read off it. Peak mem: growth of the worker's peak resident "
        "set size (VmHWM, reset via /proc/self/clear_refs) during its first run, over the resident size before "
        "it; model weights and tokens excluded.",
    ]
    table = "\n".join(lines)
    print()
    print(table)
    if args.out:
        from mechgeom._io import atomic_write

        with atomic_write(args.out) as f:
            f.write(table + "\n")
        print(f"\nwritten to {args.out}")
    if not all(math.isfinite(r["b/a"]) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
