"""Benchmark: contribution weights on two layers shaped like LLaMA-3.1-8B (issue 36), against their forward.

The model is a random ``HookedTransformer`` (a ``TransformerBridge.boot_native`` model on TransformerLens 4.x)
with LLaMA-3.1-8B's layer dimensions: ``d_model`` 4096, 32 heads, 8 KV heads, ``d_head`` 128, ``d_mlp`` 14336,
RMSNorm, rotary (base 500000), gated SiLU MLP; ``n_layers=2`` and ``d_vocab=1000`` (no 128k-token embedding), so
0.44 B parameters (1.75 GB in float32). For each length (``1 x n``) and dtype it measures, side by side in one
process (interleaved rounds, so outside load hits them alike):

- ``forward``: a plain forward of the tokens (``return_type=None``), the baseline;
- ``family``: the streamed full family, ``ContributionCollector(model, on_layer=callback)`` with every intra- and
  inter-head metric, the callback keeping nothing (``bench_contribution.py``'s (b));
- ``last_query``: ``contribution_weights(model, tokens, queries=[-1])``, every metric, the result kept;
- ``top_k``: ``contribution_weights(model, tokens, top_k=16)``, every metric, the 16 largest ``|values|`` per
  query row, head and metric kept.

Time: the median of ``--repeats`` rounds after one cold round (``--repeats 0``: the cold round's times). Peak
memory: of the cold run of each kind, above what was held before it: on CPU the resident set size
(``bench_contribution.measure``: ``VmHWM`` after resetting it), on CUDA ``torch.cuda.max_memory_allocated``.
Every tensor larger than 32 MB is its own mapping on CPU, freed when dropped, so one process gives each kind
its own peak for the tensors that matter here (``[head, q, k]`` patterns and metrics).

Each configuration is written to ``--out-dir`` as ``{device}-{dtype}-1x{n}.json``; ``--table`` prints the
Markdown table of every JSON there with the projections of :func:`roofline` (docs/benchmarks.md, "8B-shaped
layers"). ``--tiny`` shrinks the layers (``d_model`` 64) for a dry run of the script.

    nice -n 10 python benchmarks/bench_8b.py --lengths 1024 --dtypes float32 --repeats 1
    python benchmarks/bench_8b.py --table
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_contribution import measure

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "results" / "contribution" / "llama3-8b-shaped"
KINDS = ("forward", "family", "last_query", "top_k")
TOP_K = 16

#: LLaMA-3.1-8B's layer dimensions (its config.json); ``n_layers`` and ``d_vocab`` are the benchmark's.
LLAMA3_8B = {
    "d_model": 4096,
    "n_heads": 32,
    "n_key_value_heads": 8,
    "d_head": 128,
    "d_mlp": 14336,
    "rotary_base": 500000,
}
#: The same shape at ``d_model`` 64, for a dry run (``--tiny``).
TINY = {
    "d_model": 64,
    "n_heads": 4,
    "n_key_value_heads": 2,
    "d_head": 16,
    "d_mlp": 224,
    "rotary_base": 500000,
}
#: Layers of the real model, for the projection.
FULL_LAYERS = 32

#: Published peak rates of an H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet): dense BF16 tensor-core
#: FLOP/s (1979 with sparsity), FP32 FLOP/s (CUDA cores, not TF32 tensor cores), HBM3 bytes/s.
H100 = {"bf16_flops": 989e12, "fp32_flops": 67e12, "hbm_bytes": 3.35e12}


# --------------------------------------------------------------------------- model and the four kinds


def make_model(dtype: str, device: str, n_ctx: int, tiny: bool = False, seed: int = 0) -> Any:
    """Two random LLaMA-3.1-8B-shaped layers (``TINY`` with ``tiny``) in ``dtype`` on ``device``."""
    import torch

    shape = TINY if tiny else LLAMA3_8B
    kwargs = dict(
        n_layers=2,
        d_vocab=1000,
        n_ctx=n_ctx,
        act_fn="silu",
        gated_mlp=True,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_dim=shape["d_head"],
        final_rms=True,
        init_weights=True,
        seed=seed,
        dtype=getattr(torch, dtype),
        device=device,
        **shape,
    )
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
    except ImportError:  # TransformerLens 4.x
        from transformer_lens.config import TransformerBridgeConfig
        from transformer_lens.model_bridge import TransformerBridge

        model = TransformerBridge.boot_native(TransformerBridgeConfig(**kwargs)).to(device)
    else:
        model = HookedTransformer(HookedTransformerConfig(**kwargs))
    model.eval()
    return model


def kinds(model: Any, tokens: Any) -> dict[str, Callable[[], Any]]:
    """The four measurements on ``tokens`` (each returns what it keeps, dropped by the caller)."""
    from mechgeom import contribution_weights
    from mechgeom.analyses.contribution.weights import ContributionCollector
    from mechgeom.hooks import run_hooks

    def family() -> int:
        seen: list[int] = []
        col = ContributionCollector(model, on_layer=lambda layer, metrics: seen.append(layer))
        run_hooks(model, tokens, col.fwd_hooks)
        assert len(seen) == model.cfg.n_layers
        return len(seen)

    return {
        "forward": lambda: run_hooks(model, tokens, []),
        "family": family,
        "last_query": lambda: contribution_weights(model, tokens, queries=[-1]),
        "top_k": lambda: contribution_weights(model, tokens, top_k=TOP_K),
    }


def timed(fn: Callable[[], Any], device: str) -> tuple[float, float]:
    """(seconds, peak MB above what was held before) of one call; CUDA work is waited for."""
    import torch

    if not device.startswith("cuda"):
        dt, mb, out = measure(fn)
        del out
        return dt, mb
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del out
    return dt, (torch.cuda.max_memory_allocated() - before) / 2**20


def bench(n: int, dtype: str, repeats: int, device: str, tiny: bool, only: tuple[str, ...]) -> dict[str, Any]:
    """One configuration in this process: a cold round (time and peak of each kind), then ``repeats``
    interleaved rounds."""
    import torch

    t0 = time.perf_counter()
    model = make_model(dtype, device, n_ctx=n, tiny=tiny)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, int(model.cfg.d_vocab), (1, n), generator=g).to(device)
    fns = {k: f for k, f in kinds(model, tokens).items() if k in only}
    res: dict[str, dict[str, Any]] = {}
    for kind, fn in fns.items():
        dt, mb = timed(fn, device)
        res[kind] = {"cold_s": dt, "peak_mb": mb, "times": []}
        print(f"  {dtype} 1x{n} {kind}: cold {dt:.2f} s, peak {mb:.0f} MB", file=sys.stderr, flush=True)
    for _ in range(repeats):
        for kind, fn in fns.items():
            res[kind]["times"].append(timed(fn, device)[0])
    for r in res.values():
        r["median_s"] = statistics.median(r["times"] or [r["cold_s"]])
    return {
        "n": n,
        "dtype": dtype,
        "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
        "threads": torch.get_num_threads(),
        "tiny": tiny,
        "layers": int(model.cfg.n_layers),
        "repeats": repeats,
        "build_s": build_s,
        "torch": torch.__version__,
        "kinds": res,
    }


# --------------------------------------------------------------------------- roofline


def roofline(n: int, dtype: str, shape: dict[str, int] = LLAMA3_8B) -> dict[str, dict[str, float]]:
    """FLOPs and bytes of one layer of each kind on one text of ``n`` tokens (see docs/benchmarks.md, "8B-shaped
    layers", for the formulas), and the least time an H100 SXM takes for them (``max(flops / peak, bytes /
    bandwidth)``, peak: BF16 tensor cores for bfloat16, FP32 CUDA cores for float32; the metrics are computed in
    float32 either way, so they get the FP32 rate)."""
    D, H, G = shape["d_model"], shape["n_heads"], shape["n_key_value_heads"]
    d, F = shape["d_head"], shape["d_mlp"]
    s = 2 if dtype == "bfloat16" else 4  # bytes per model element
    P = 2 * D * H * d + 2 * D * G * d + 3 * D * F  # W_Q, W_O, W_K, W_V, gated MLP
    fwd_flops = 2 * n * P + 4 * H * n * n * d  # the weights' matmuls; q.k and pattern.v over the full square
    fwd_bytes = P * s + 4 * H * n * n * s + n * (12 * D + 4 * F) * s
    written = 6 * H + 4  # [q, k] tensors written per layer (6 intra besides attention, 4 inter), float32
    # two q x k products in d_head per head (<o_h, vt> and <o, vt>), the [head, head] quadratic form of the
    # inter-head norm, ~10 elementwise FLOPs per written entry; causal: the lower half of q x k.
    fam_flops = (2 * 2 * H * d + 2 * H * H + 10 * written) * n * n / 2
    fam_bytes = (written * 4 + H * s) * n * n / 2  # metrics written (float32), the pattern read
    top_bytes = fam_bytes + written * 4 * n * n / 2  # each block's metrics written, then read for the top k
    last_flops = (2 * 2 * H * d + 2 * H * H + 10 * written) * n
    last_bytes = (H * s + 2 * G * d * s) * n  # the last pattern row of every head, v
    rate = H100["bf16_flops"] if dtype == "bfloat16" else H100["fp32_flops"]
    out = {
        "forward": {"flops": fwd_flops, "bytes": fwd_bytes, "rate": rate},
        "family": {"flops": fam_flops, "bytes": fam_bytes, "rate": H100["fp32_flops"]},
        "last_query": {"flops": last_flops, "bytes": last_bytes, "rate": H100["fp32_flops"]},
        "top_k": {"flops": fam_flops, "bytes": top_bytes, "rate": H100["fp32_flops"]},
    }
    for v in out.values():
        v["h100_s"] = max(v["flops"] / v["rate"], v["bytes"] / H100["hbm_bytes"])
    return out


def table(out_dir: Path) -> str:
    """The Markdown table of every configuration measured in ``out_dir``: per kind its time and its ratio to
    the forward (the metrics kinds include their forward), its peak, the time projected to 32 layers (linear
    in layers) and the H100 roofline of 32 layers (forward + metrics for the metric kinds)."""
    rows = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]
    rows.sort(key=lambda r: (r["device"], r["dtype"], r["n"]))
    lines = [
        "| device | dtype | tokens | kind | time, 2 layers | ratio to forward | peak | time, 32 layers "
        "(projected) | H100 roofline, 32 layers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = r["kinds"]
        roof = roofline(r["n"], r["dtype"], TINY if r["tiny"] else LLAMA3_8B)
        base = k["forward"]["median_s"] if "forward" in k else float("nan")
        for kind, m in k.items():
            t = m["median_s"]
            h100 = roof["forward"]["h100_s"] + (roof[kind]["h100_s"] if kind != "forward" else 0.0)
            lines.append(
                f"| {r['device']} | {r['dtype']} | 1x{r['n']} | {kind} | {t:.2f} s | {t / base:.2f} | "
                f"{m['peak_mb'] / 1024:.2f} GB | {t * FULL_LAYERS / r['layers']:.0f} s | "
                f"{h100 * FULL_LAYERS * 1e3:.1f} ms |"
            )
    return "\n".join(lines)


def roofline_table(lengths: tuple[int, ...] = (1024, 2048, 4096)) -> str:
    """The H100 roofline of 32 layers per length and dtype: the forward's least time and each metric kind's
    time on top of it (both sides at their roofline), as ratios to the forward."""
    lines = [
        "| dtype | tokens | forward, 32 layers | + streamed family | + last query | + top_k=16 |",
        "|---|---|---|---|---|---|",
    ]
    for dtype in ("float32", "bfloat16"):
        for n in lengths:
            r = roofline(n, dtype)
            fwd = r["forward"]["h100_s"]
            cells = [f"{(fwd + r[k]['h100_s']) / fwd:.2f}x" for k in ("family", "last_query", "top_k")]
            lines.append(
                f"| {dtype} | 1x{n} | {fwd * FULL_LAYERS * 1e3:.1f} ms | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds after the cold one")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {','.join(KINDS)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--tiny", action="store_true", help="d_model 64 instead of 4096 (a dry run)")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--table", action="store_true", help="print the table of --out-dir and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.out_dir))
        print()
        print(roofline_table())
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    only = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(only) - set(KINDS)
    if unknown:
        p.error(f"unknown --kinds {sorted(unknown)}; choose from {','.join(KINDS)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes.split(","):
        for n in (int(x) for x in args.lengths.split(",")):
            row = bench(n, dtype, args.repeats, args.device, args.tiny, only)
            dev = args.device.split(":")[0] + ("-tiny" if args.tiny else "")
            path = args.out_dir / f"{dev}-{dtype}-1x{n}.json"
            path.write_text(json.dumps(row, indent=1) + "\n")
            k = row["kinds"]
            base = k["forward"]["median_s"] if "forward" in k else float("nan")
            ratios = ", ".join(f"{kind} {m['median_s'] / base:.2f}x" for kind, m in k.items())
            print(f"{dtype} 1x{n}: forward {base:.2f} s; {ratios} -> {path}", flush=True)


if __name__ == "__main__":
    main()
