"""Benchmark: contribution weights (``docs/definitions.md`` §2) on SmolLM2-135M, against a plain cache and a naive reference.

For each input shape (batch x tokens) it measures, side by side in one process (``--isolate``: each in a
fresh worker process instead):

(a) ``run_with_cache`` of the activations the metrics need (``hook_pattern``, ``hook_v``, ``hook_z`` of all
    30 layers, ``names_filter``), ``return_type=None``: the forward pass a user pays to get the inputs.
(a0) a plain forward pass (``return_type=None``), nothing cached: the floor of any hook-based analysis.
(b) mechgeom, the default path: one forward pass with :class:`ContributionCollector` hooks computing the
    whole metric family (7 intra-head + 4 inter-head metrics) for all 30 layers, streamed to an ``on_layer``
    callback that drops each layer's tensors after they are computed (PyTorch is eager: every metric is
    fully materialised as a ``[batch, head, q, k]`` / ``[batch, q, k]`` tensor before the callback sees it).
    Since the callback keeps no reference, the collector recycles the output tensors for the next layer by
    itself. What a consumer then does with them (write, reduce, rank) is its own cost, excluded from (b)
    and (c) alike. Memory stays at one layer of results.
(b') the same with ``reuse_buffers=True`` (recycling by contract rather than by the storage count).
(c) naive: the same forward as (a), then for every layer and head ``alpha[h,i,j] * vt[j,h]`` materialised as
    a ``[q, k, d_model]`` tensor (in query chunks of at most ``--chunk-mb``) and every metric read off it
    with norms and inner products. When the projected time exceeds ``--naive-budget`` seconds, only the
    first layers are run and the time is extrapolated linearly to all 30 (every layer costs the same); the
    table says so.
(d) the peers' way: the same forward as (a), then per layer and text ``alpha[h,i,j] * vt[j,h]`` materialised
    whole as ``[q, k, head, d_model]`` (as ALTI-style per-head source attributions do) and the family read off
    it; run only while that tensor stays under ``--peer-max-gb`` (else "not run"), and extrapolated from the
    first layers like (c).

Shapes of ``--stream-only-from`` tokens and more (default 2048) run only (a0) and (b), once each, in fresh
workers: caching every layer's pattern for (a) would need ``30 * heads * q * q`` floats (18 GB at 1 x 4096).

After the timings, a roofline estimate per shape: the bytes the metrics write per layer, the FLOPs they need
per layer, this machine's measured write bandwidth and matmul throughput, and so the least time the
metrics could take per layer, beside what (b) - (a0) measures per layer (paired round by round); and the
forward's own FLOPs, the rate (a0) ran them at, and the family's FLOPs as a share of them.

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

SHAPES = "1x128,1x256,1x512,1x1024,4x512,1x4096"
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


def run_plain(model: Any, tokens: Any) -> None:
    import torch

    with torch.no_grad():
        model(tokens, return_type=None)


def run_mechgeom(model: Any, tokens: Any, reuse_buffers: bool = False) -> int:
    from mechgeom.analyses.contribution.weights import ContributionCollector
    from mechgeom.hooks.readers import run_hooks

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


def peer_gb(alpha_shape: tuple[int, ...], d_model: int) -> float:
    """Size of one text's ``[q, k, head, d_model]`` float32 tensor, in GB."""
    _, H, Q, K = alpha_shape
    return Q * K * H * d_model * 4 / 1e9


def peer_layer(alpha: Any, v_kv: Any, W_O: Any) -> dict[str, float]:
    """Every §A metric of one layer from ``alpha * vt`` materialised whole as ``[q, k, head, d_model]`` per text."""
    import torch

    B, H = alpha.shape[:2]
    group = H // v_kv.shape[2]
    checksum = 0.0
    for b in range(B):
        v = v_kv[b].repeat_interleave(group, dim=1)  # [k h d]
        vt = torch.einsum("khd,hdm->khm", v, W_O)  # [k h m]
        T = alpha[b].permute(1, 2, 0)[..., None] * vt[None]  # [q k h m], materialised
        o_h = T.sum(1)  # [q h m]
        o = o_h.sum(1)  # [q m]
        on_h, on = o_h.norm(dim=-1), o.norm(dim=-1)  # [q h], [q]
        vw = T.norm(dim=-1)  # [q k h]
        vwn = vw / on_h[:, None]
        c = torch.einsum("qkhm,qhm->qkh", T, o_h) / (on_h**2)[:, None]
        share = torch.einsum("qkhm,qm->qkh", T, o) / (on**2)[:, None, None]
        ratio = vt.norm(dim=-1)[None] / on_h[:, None]
        cos = torch.einsum("qhm,khm->qkh", o_h, vt) / (on_h[:, None] * vt.norm(dim=-1)[None])
        T_l = T.sum(2)  # [q k m]
        del T
        vw_i = T_l.norm(dim=-1)
        c_i = torch.einsum("qkm,qm->qk", T_l, o) / (on**2)[:, None]
        del T_l
        for x in (vw, vwn, c, share, ratio, cos, vw_i, vw_i / on[:, None], c_i, alpha[b].mean(0)):
            checksum += float(x.nansum())
    return {"checksum": checksum}


def run_per_layer(model: Any, tokens: Any, budget_s: float, layer_fn: Any) -> dict[str, Any]:
    """The forward of (a), then ``layer_fn(pattern, v, W_O)`` per layer, extrapolated to every layer once
    the projected total passes ``budget_s``."""
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
            layer_fn(cache[p + "hook_pattern"], cache[p + "hook_v"], model.W_O[layer].detach())
            done += 1
            if (time.perf_counter() - t1) / done * n_layers > budget_s and done < n_layers:
                break
    t_metrics = time.perf_counter() - t1
    return {
        "forward_s": t_fwd,
        "layers_run": done,
        "metrics_s_measured": t_metrics,
        "total_s": t_fwd + t_metrics / done * n_layers,
    }


def run_peer(model: Any, tokens: Any, budget_s: float) -> dict[str, Any]:
    """(d): the forward of (a), then :func:`peer_layer` per layer (extrapolated past ``budget_s``)."""
    return run_per_layer(model, tokens, budget_s, peer_layer)


def run_naive(model: Any, tokens: Any, budget_s: float, chunk_mb: float) -> dict[str, Any]:
    """(c): the forward of (a), then :func:`naive_layer` per layer (extrapolated past ``budget_s``)."""
    return run_per_layer(model, tokens, budget_s, lambda p, v, w: naive_layer(p, v, w, chunk_mb))


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
    elif args.worker == "peer":
        dt, mb, info = measure(lambda: run_peer(model, tokens, args.naive_budget))
        out.update(info, peak_mb=mb, times=[info["total_s"]])
    else:
        fns = {
            "plain": lambda: run_plain(model, tokens),
            "cache": lambda: run_cache(model, tokens),
            "mechgeom": lambda: run_mechgeom(model, tokens),
            "reuse": lambda: run_mechgeom(model, tokens, reuse_buffers=True),
        }
        fn = fns[args.worker]
        dt0, mb, res = measure(fn)  # first (cold) run: memory; also the warm-up
        del res
        times = [] if args.repeats else [dt0]
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
        "plain": lambda: run_plain(model, tokens),
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
    gb = peer_gb((batch, int(model.cfg.n_heads), seq, seq), int(model.cfg.d_model))
    if gb <= args.peer_max_gb:
        info = run_peer(model, tokens, args.naive_budget)
        res["peer"] = {**info, "times": [info["total_s"]]}
    for kind in res:
        res[kind]["peak_mb"] = spawn(kind, batch, seq, args, memory_only=True)["peak_mb"]
    if "peer" not in res:
        res["peer"] = {
            "total_s": math.nan,
            "layers_run": 0,
            "peak_mb": math.nan,
            "note": f"not run ({gb:.1f} GB per text)",
        }
    return res


def stream_only(batch: int, seq: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """A long shape: (a0) and (b) once each, in fresh workers (time of the cold run and its peak)."""
    res = {kind: spawn(kind, batch, seq, args, memory_only=True) for kind in ("plain", "mechgeom")}
    nan = {"times": [math.nan], "peak_mb": math.nan, "total_s": math.nan, "layers_run": 0}
    for kind in ("cache", "reuse", "naive", "peer"):
        res[kind] = dict(nan)
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
    if not math.isfinite(x):
        return "not run"
    return f"{x:.2f} s" if x < 100 else f"{x:.0f} s"


def short_s(x: float, note: str) -> str:
    """A time for the one-line output: ``6.9s (extrapolated ...)``, or the note alone (``not run (...)``)."""
    return note.strip() if not math.isfinite(x) and note else f"{x:.1f}s{note}"


def cell_s(x: float, note: str) -> str:
    """A time for the markdown table, as :func:`fmt_s` with its note, or the note alone when there is no time."""
    return note.strip() if not math.isfinite(x) and note else f"{fmt_s(x)}{note}"


def fmt_mb(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.0f}"


def fmt_x(x: float, digits: int = 2) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


# --------------------------------------------------------------------------- roofline


def machine_limits(threads: int) -> dict[str, float]:
    """This machine's write bandwidth (GB/s, ``fill_`` of 512 MB touched before) and float32 matmul
    throughput (GFLOP/s, a ``[1024, 576] @ [576, 576]`` product, the metrics' largest), best of 5."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.zeros(2**27)  # 512 MB, pages touched
    bw = []
    for _ in range(5):
        t0 = time.perf_counter()
        buf.fill_(1.0)
        bw.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    x, w = torch.randn(1024, 576), torch.randn(576, 576)
    fl = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            x @ w
        fl.append(10 * 2 * 1024 * 576 * 576 / (time.perf_counter() - t0) / 1e9)
    return {"write_gbs": max(bw), "gflops": max(fl)}


def layer_cost(batch: int, seq: int, n_heads: int, d_head: int, block: int | None = None) -> dict[str, float]:
    """Bytes the full family writes per layer and the FLOPs it needs per layer (mechgeom's formulation).

    Written: 6 intra-head ``[b, h, q, q]`` outputs (attention is the pattern itself) and 4 inter-head
    ``[b, q, q]``, float32, each causal entry (key <= query) once (the keys after a query stay 0 in the
    recycled buffers and are not written again). FLOPs (2 per multiply-add): ``o[i] W_Oᵀ`` for every head
    (``(h d)²`` per token), the value Gram in ``d_head`` (each of the ``h (h + 1) / 2`` head pairs once), the
    per-head quadratic form ``z M[h]``, the two ``q x k`` products in ``d_head`` per head (cosine and head
    shares) over the causal blocks (a matmul per block of ``block`` queries, by default the fused sweep's
    ``FUSED_BLOCK_SIZE``), and ``2 h²`` per entry for the inter-head value norm. The modified-``z`` check
    does not run here: no other hook is attached (``LayerCollector``).
    """
    from mechgeom.analyses.contribution.geometry import FUSED_BLOCK_SIZE

    H, D, B, Q = n_heads, d_head, batch, seq
    block = block or FUSED_BLOCK_SIZE
    seen = sum(min(block, Q - q0) * min(q0 + block, Q) for q0 in range(0, Q, block))  # (q, k) per block
    causal = Q * (Q + 1) // 2  # (q, k) with k <= q
    written = (6 * H + 4) * B * causal * 4
    flops = 2 * B * Q * (H * D) ** 2  # layer_u
    flops += 2 * B * Q * (H * (H + 1) // 2) * D * D  # gram, each unordered head pair once
    flops += 2 * B * Q * H * D * D  # head_u
    flops += 2 * 2 * B * H * D * seen  # cos, shares
    flops += 2 * H * H * B * causal  # inter-head value norm, over the sources only
    return {"bytes": float(written), "flops": float(flops)}


def forward_flops(batch: int, seq: int, cfg: Any) -> float:
    """FLOPs of the model's forward pass with ``return_type=None`` (2 per multiply-add; no unembedding, which
    TransformerLens skips then): per token and layer, the projections ``W_Q``, ``W_K``, ``W_V`` (one per KV
    head), ``W_O`` and the MLP (three matrices when gated, else two), plus ``q kᵀ`` and ``alpha v`` over every
    key (TransformerLens computes the whole square and masks it)."""
    d, H, D, L = int(cfg.d_model), int(cfg.n_heads), int(cfg.d_head), int(cfg.n_layers)
    kv = int(getattr(cfg, "n_key_value_heads", None) or H)
    mlp = (
        0
        if getattr(cfg, "attn_only", False)
        else (3 if getattr(cfg, "gated_mlp", False) else 2) * d * int(cfg.d_mlp)
    )
    per_token = 2 * (d * (H + 2 * kv) * D + H * D * d + mlp) + 2 * 2 * H * D * seq
    return float(L * batch * seq * per_token)


# --------------------------------------------------------------------------- driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated BATCHxTOKENS")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--naive-budget", type=float, default=120.0, help="seconds before (c) and (d) extrapolate"
    )
    ap.add_argument("--chunk-mb", type=float, default=256.0, help="largest [q,k,d_model] chunk of (c)")
    ap.add_argument("--peer-max-gb", type=float, default=4.0, help="largest [q,k,head,d_model] tensor of (d)")
    ap.add_argument("--stream-only-from", type=int, default=2048, help="tokens from which only (a0), (b) run")
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
    ap.add_argument(
        "--worker", choices=["plain", "cache", "mechgeom", "reuse", "naive", "peer"], help=argparse.SUPPRESS
    )
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
        if seq >= args.stream_only_from:
            res = stream_only(batch, seq, args)
        elif model is None:
            kinds = ("plain", "cache", "mechgeom", "reuse", "naive", "peer")
            res = {kind: spawn(kind, batch, seq, args) for kind in kinds}
        else:
            res = in_process(model, batch, seq, args)
        t0 = statistics.median(res["plain"]["times"])
        ta = statistics.median(res["cache"]["times"])
        tb = statistics.median(res["mechgeom"]["times"])
        tr = statistics.median(res["reuse"]["times"])
        tc, td = res["naive"]["total_s"], res["peer"]["total_s"]
        notes = {}
        for k in ("naive", "peer"):
            n_run = res[k]["layers_run"]
            notes[k] = res[k].get("note", "") or (
                "" if n_run in (0, 30) else f" (extrapolated from {n_run}/30 layers)"
            )
        rounds = [b / a for a, b in zip(res["cache"]["times"], res["mechgeom"]["times"], strict=True)]
        # (b) - (a0) paired round by round (a slow round slows both), for the roofline
        extra = statistics.median(
            b - p for p, b in zip(res["plain"]["times"], res["mechgeom"]["times"], strict=True)
        )
        rows.append(
            {
                "shape": f"{batch}×{seq}",
                "batch": batch,
                "seq": seq,
                **{"a0": t0, "a": ta, "b": tb, "r": tr, "c": tc, "d": td},
                "c_note": notes["naive"],
                "d_note": notes["peer"],
                "b/a": tb / ta,
                "b/a0": tb / t0,
                "r/a": tr / ta,
                "c/b": tc / tb,
                "d/b": td / tb,
                "rounds": rounds,
                "extra": extra,
                **{f"mem_{k}": res[kind]["peak_mb"] for k, kind in
                   (("a0", "plain"), ("a", "cache"), ("b", "mechgeom"), ("r", "reuse"), ("c", "naive"), ("d", "peer"))},
            }
        )  # fmt: skip
        r = rows[-1]
        print(
            f"{batch}x{seq}: a0={t0:.2f}s a={ta:.2f}s b={tb:.2f}s b'={tr:.2f}s c={short_s(tc, r['c_note'])} "
            f"d={short_s(td, r['d_note'])}  b/a={tb / ta:.2f} (rounds {', '.join(f'{x:.2f}' for x in rounds)}) "
            f"b/a0={tb / t0:.2f} b'/a={tr / ta:.2f} c/b={tc / tb:.1f} d/b={td / tb:.1f}  peak MB "
            f"a0={fmt_mb(r['mem_a0'])} a={fmt_mb(r['mem_a'])} b={fmt_mb(r['mem_b'])} b'={fmt_mb(r['mem_r'])} "
            f"c={fmt_mb(r['mem_c'])} d={fmt_mb(r['mem_d'])}",
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
        f"median of {args.repeats} runs after a warm-up ((c), (d) and shapes of {args.stream_only_from}+ "
        "tokens: one run).",
        "",
        "| batch × tokens | (a0) forward | (a) run_with_cache | (b) mechgeom, full family | (b′) reuse_buffers "
        "| (c) naive `[q,k,d_model]` | (d) peers' `[q,k,head,d_model]` | b/a | b/a per round | b/a0 | b′/a "
        "| c/b | d/b | peak mem (a0) / (a) / (b) / (b′) / (c) / (d), MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mems = " / ".join(fmt_mb(r[f"mem_{k}"]) for k in ("a0", "a", "b", "r", "c", "d"))
        lines.append(
            f"| {r['shape']} | {fmt_s(r['a0'])} | {fmt_s(r['a'])} | {fmt_s(r['b'])} | {fmt_s(r['r'])} "
            f"| {cell_s(r['c'], r['c_note'])} | {cell_s(r['d'], r['d_note'])} | {fmt_x(r['b/a'])} "
            f"| {', '.join(fmt_x(x) for x in r['rounds'])} | {fmt_x(r['b/a0'])} | {fmt_x(r['r/a'])} "
            f"| {fmt_x(r['c/b'], 1)} | {fmt_x(r['d/b'], 1)} | {mems} |"
        )
    lim = machine_limits(args.threads)
    cfg = model.cfg if model is not None else None
    n_heads = int(cfg.n_heads) if cfg is not None else 9
    d_head = int(cfg.d_head) if cfg is not None else 64
    n_layers = int(cfg.n_layers) if cfg is not None else 30
    lines += [
        "",
        f"Roofline per layer: this machine writes {lim['write_gbs']:.1f} GB/s (`fill_` of 512 MB) and multiplies "
        f"at {lim['gflops']:.0f} GFLOP/s (float32 `[1024,576] @ [576,576]`); the least time of the metrics is "
        "the larger of bytes / bandwidth and FLOPs / throughput; measured is (b) − (a0) per layer, the median "
        "over the rounds of their difference in each round. The forward's FLOPs (`return_type=None`: "
        "projections, MLP, and `q kᵀ`, `alpha v` over the whole square, as TransformerLens computes them) and "
        "the rate (a0) ran them at; the family's FLOPs over all layers as a share of the forward's: at the "
        "forward's own rate, and with nothing else to do, b/a would be 1 + that share.",
        "",
        "| batch × tokens | written per layer | FLOPs per layer | bound: write | bound: compute "
        "| measured per layer | measured / bound | forward: FLOPs, GFLOP/s in (a0) | family / forward FLOPs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = layer_cost(r["batch"], r["seq"], n_heads, d_head)
        t_w, t_f = c["bytes"] / lim["write_gbs"] / 1e9, c["flops"] / lim["gflops"] / 1e9
        meas = r["extra"] / n_layers
        fwd = forward_flops(r["batch"], r["seq"], cfg) if cfg is not None else math.nan
        lines.append(
            f"| {r['shape']} | {c['bytes'] / 1e6:.0f} MB | {c['flops'] / 1e9:.2f} G | {t_w * 1e3:.1f} ms "
            f"| {t_f * 1e3:.1f} ms | {meas * 1e3:.1f} ms | {meas / max(t_w, t_f):.1f}× "
            f"| {fwd / 1e9:.0f} G, {fwd / r['a0'] / 1e9:.0f} | {n_layers * c['flops'] / fwd:.0%} |"
        )
    lines += [
        "",
        "(a0) a plain forward (`return_type=None`); (a) forward pass caching hook_pattern/hook_v/hook_z of every "
        "layer; (b) one forward pass with the collector computing all 7 intra-head and 4 inter-head metrics of "
        "every layer, streamed to a callback that drops them (the collector then recycles the output tensors by "
        "itself); (b′) the same with `reuse_buffers=True`; (c) the forward of (a) plus, per layer and head, "
        f"`alpha * vt` materialised as `[q, k, d_model]` (query chunks of at most {args.chunk_mb:.0f} MB) with "
        "every metric read off it; (d) the same from `[q, k, head, d_model]` materialised whole per text "
        f"(not run above {args.peer_max_gb:.0f} GB). Peak mem: growth of the worker's peak resident set size "
        "(VmHWM, reset via /proc/self/clear_refs) during its first run, over the resident size before it; "
        "model weights and tokens excluded.",
    ]
    table = "\n".join(lines)
    print()
    print(table)
    if args.out:
        from mechgeom._io import atomic_write

        with atomic_write(args.out) as f:
            f.write(table + "\n")
        print(f"\nwritten to {args.out}")
    if not all(math.isfinite(r["b/a0"]) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
