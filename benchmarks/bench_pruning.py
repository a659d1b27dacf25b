"""Single-head ablation sweep: time per head against one plain forward of the same batch, in one process.

Three numbers, same tokens, same process:

- ``plain forward``: one clean ``text_nll`` pass over the batch;
- ``sweep, full forward per head``: ``single_head_sweep(start_at_layer=False)`` (one full pass per head);
- ``sweep, start_at_layer``: ``single_head_sweep(start_at_layer=True)`` (the clean residual stream is advanced
  block by block; each head of layer ``l`` runs only layers ``>= l`` plus the unembedding).

Heads are sampled evenly over layers (``--heads-per-layer``), so the per-head time is the average over depth
that a full sweep would see; the fixed costs of each sweep (its clean pass, the embedding) are included.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/bench_pruning.py --n-texts 8 --seq-len 128
"""

from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-texts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--heads-per-layer", type=int, default=1)
    ap.add_argument("--layer-stride", type=int, default=3, help="benchmark every k-th layer")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from mechgeom import load_model
    from mechgeom.analyses.heads.pruning import single_head_sweep
    from mechgeom.analyses.scoring import text_nll
    from mechgeom.data import load_corpus

    model = load_model(args.model)
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=0)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    heads = [
        (layer, h) for layer in range(0, n_layers, args.layer_stride) for h in range(args.heads_per_layer)
    ]

    text_nll(model, tokens[: args.batch_size], batch_size=args.batch_size)  # warm-up
    t0 = time.perf_counter()
    text_nll(model, tokens, batch_size=args.batch_size)
    plain = time.perf_counter() - t0

    timings = {}
    results = {}
    for fast in (False, True):
        t0 = time.perf_counter()
        results[fast] = single_head_sweep(
            model, tokens, heads=heads, batch_size=args.batch_size, start_at_layer=fast
        )
        timings[fast] = (time.perf_counter() - t0) / len(heads)
    diff = max(
        abs(results[True].nll[lh] - results[False].nll[lh]).max().item() for lh in heads
    )  # the two sweeps must agree

    n_all = n_layers * n_heads
    print(
        f"model={args.model} tokens={tuple(tokens.shape)} threads={torch.get_num_threads()} heads timed={len(heads)}"
    )
    print(f"{'what':<34}{'seconds':>10}{'x plain fwd':>13}{'full sweep (est.)':>20}")
    print(f"{'plain forward (batch)':<34}{plain:>10.2f}{1.0:>13.2f}{'':>20}")
    for fast, label in ((False, "sweep per head, full forward"), (True, "sweep per head, start_at_layer")):
        t = timings[fast]
        print(f"{label:<34}{t:>10.2f}{t / plain:>13.2f}{t * n_all / 60:>16.1f} min")
    print(
        f"speed-up start_at_layer: {timings[False] / timings[True]:.2f}x; max |ΔNLL| between the two: {diff:.2e}"
    )


if __name__ == "__main__":
    main()
