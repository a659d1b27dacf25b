"""Masked forward passes vs plain forward passes, side by side in one process (SmolLM2 by default).

The masked pass is what :func:`mechgeom.analyses.faithfulness.perplexity_curves` runs for every (metric, mode,
rate): a forward-only pass with the ``hook_pattern`` masking hooks on every layer, the boolean mask built
on the fly from the stored clean ranks. The plain pass is the same batched forward without hooks. Passes
are interleaved (plain, masked, plain, masked, ...) so that load from other processes hits both alike.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/bench_faithfulness.py --batch 8 --seq-len 256
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2, help="timed passes of each kind")
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--metric", default="contribution")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from mechgeom import load_model
    from mechgeom.analyses.faithfulness import FAITHFULNESS_METRICS, source_rankings
    from mechgeom.analyses.scoring import target_logprob
    from mechgeom.data import load_corpus
    from mechgeom.hooks import masking_hooks

    model = load_model(args.model)
    tokens = load_corpus("wikitext2", model, n_texts=args.batch, seq_len=args.seq_len, seed=0)
    targets = torch.ones(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.bool)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    t0 = time.perf_counter()
    rankings = source_rankings(model, tokens, metrics=FAITHFULNESS_METRICS)
    t_rank = time.perf_counter() - t0
    rank_mb = sum(r.nbytes for r in rankings.values()) / 2**20
    ranking = rankings[args.metric]

    kinds = {
        "plain": [],
        "masked comprehensiveness": masking_hooks(
            model, ranking=ranking, rate=args.rate, mode="comprehensiveness"
        ),
        "masked sufficiency": masking_hooks(model, ranking=ranking, rate=args.rate, mode="sufficiency"),
    }
    target_logprob(model, tokens, targets, [])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.reps):
        for kind, hooks in kinds.items():
            t0 = time.perf_counter()
            target_logprob(model, tokens, targets, hooks)
            times[kind].append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    plain = statistics.median(times["plain"])
    print(
        f"model={args.model} batch={args.batch} seq_len={args.seq_len} layers=all ({model.cfg.n_layers}) "
        f"heads={model.cfg.n_heads} rate={args.rate} metric={args.metric} threads={torch.get_num_threads()} "
        f"reps={args.reps}"
    )
    print(f"{'pass':<26} {'median s':>9} {'passes/s':>9} {'texts/s':>8} {'vs plain':>9}")
    for kind, ts in times.items():
        med = statistics.median(ts)
        print(f"{kind:<26} {med:9.2f} {1 / med:9.3f} {args.batch / med:8.2f} {plain / med:9.2f}")
    print(
        f"clean pass with all {len(rankings)} rankings: {t_rank:.1f} s; "
        f"ranks stored: {rank_mb:.0f} MiB ({next(iter(ranking.ranks.values())).dtype}); "
        f"peak RSS: {rss:.0f} MiB (after model load: {rss0:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
