"""Every analysis on SmolLM2-135M in bfloat16 on a device (``scripts/gpu_check.sh``, part b).

Loads the offline SmolLM2 with ``load_model("smollm2-135m", device=..., dtype=torch.bfloat16)``, runs each
analysis entry point on two short texts and checks, for each result: every tensor it holds is finite where the
analysis defines it (NaN is allowed, inf is not), no head is marked modified (nothing intervenes), and the
contribution rows of every kept query sum to 1 within ``--tol`` (intra-head per head, inter-head per layer;
``docs/definitions.md`` §2). Prints one line per analysis with its wall time (CUDA work waited for) and exits
non-zero on the first failed check.

    python scripts/gpu_smoke.py --device cuda
    python scripts/gpu_smoke.py --device cpu --dtype float32   # a dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import mechgeom
from mechgeom.models import load_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Attention sinks collect much of the attention mass in many heads of a language model.",
]


def analyses(texts: list[str]) -> dict[str, Callable[[Any], Any]]:
    """Each public analysis entry point, on ``texts``."""
    return {
        "contribution_weights": lambda m: mechgeom.contribution_weights(m, texts),
        "contribution_weights(queries=[-1])": lambda m: mechgeom.contribution_weights(m, texts, queries=[-1]),
        "contribution_weights(top_k=16)": lambda m: mechgeom.contribution_weights(m, texts, top_k=16),
        "contribution_overview": lambda m: mechgeom.contribution_overview(m, texts),
        "sink_statistics": lambda m: mechgeom.sink_statistics(m, texts),
        "token_selection": lambda m: mechgeom.token_selection(m, texts),
        "classify_heads": lambda m: mechgeom.classify_heads(m, texts),
        "head_stats": lambda m: mechgeom.head_stats(m, texts),
        "attention_rollout": lambda m: mechgeom.attention_rollout(m, texts),
        "source_rankings": lambda m: mechgeom.source_rankings(m, texts),
        "convexity_check": lambda m: mechgeom.convexity_check(
            m, texts[0], heads=[(0, 0), (5, 1)], s_values=[0.0, 0.5, 1.0]
        ),  # one text: it intervenes at the same positions of every text
        "perplexity": lambda m: mechgeom.perplexity(m, mechgeom.to_tokens(m, texts[0])),
    }


def fields(result: Any) -> dict[str, Any]:
    """The result's fields (a dataclass) or the result itself under ``"value"``."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return {"value": result}


def check(name: str, result: Any, tol: float) -> list[str]:
    """The failed checks of one result (empty: all passed)."""
    bad: list[str] = []
    for key, value in fields(result).items():
        tensors = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            where = key if sub is None else f"{key}[{sub!r}]"
            if t.is_floating_point() and bool(torch.isinf(t).any()):
                bad.append(f"{where}: inf")
            if "modified" in key and t.numel() and bool((t != 0).any()):
                bad.append(f"{where}: a head is marked modified")
    if isinstance(result, mechgeom.ContributionResult) and result.top_k is None:
        for kind, metrics in (("intra", result.intra), ("inter", result.inter)):
            rows = metrics["contribution"].double().sum(-1)  # [b l (h) q]: every kept query's row
            real = ~rows.isnan() & (rows != 0)  # padding rows are 0; NaN rows have no output
            err = (rows[real] - 1).abs().max().item() if bool(real.any()) else float("nan")
            if not err <= tol:
                bad.append(f"{kind} contribution rows sum to 1 within {err:.2e}, above {tol:g}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    model = load_model("smollm2-135m", device=args.device, dtype=getattr(torch, args.dtype))
    print(
        f"load_model(smollm2-135m, {args.device}, {args.dtype}): {time.perf_counter() - t0:.1f} s", flush=True
    )
    failed = 0
    for name, fn in analyses(TEXTS).items():
        sync()
        t0 = time.perf_counter()
        try:
            result = fn(model)
            sync()
            bad = check(name, result, args.tol)
        except Exception as exc:  # report every analysis, then fail
            bad = [f"{type(exc).__name__}: {exc}"]
        dt = time.perf_counter() - t0
        failed += bool(bad)
        print(f"{'FAIL' if bad else 'ok  '} {name}: {dt * 1e3:.0f} ms {'; '.join(bad)}", flush=True)
    if args.device.startswith("cuda"):
        print(f"peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
