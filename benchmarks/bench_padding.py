"""Benchmark: a padded batch of texts of mixed length against the same texts one by one, on SmolLM2-135M.

``contribution_weights`` on every layer with the full metric family (7 intra-head + 4 inter-head metrics), for
``--n-texts`` texts (default 8) of the lengths ``--lengths`` (wikitext-2 windows cut to those lengths and
decoded, so the tokenizer sees text): once as one padded batch (a list of texts: ``to_batch`` pads them on the
tokenizer's ``padding_side``, or ``--padding-side``), once text by text. Each is set against a plain forward
pass of the same inputs in the same process:

(p1) a plain forward of the padded batch (``run_hooks`` with the batch's attention mask, no hook);
(pn) plain forwards of the texts one by one;
(c1) ``contribution_weights(model, texts)``: the padded batch, every layer, the result kept;
(cn) ``contribution_weights(model, text)`` for each text.

Time: median of ``--repeats`` interleaved rounds (p1, pn, c1, cn, p1, ...) after one warm-up of each, in one
process. Memory, from a fresh worker process per kind: the growth of the peak resident set size during one cold
run (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, as ``bench_contribution.py`` measures it),
which for (c1) includes the padded result (``batch x 30 x 9 x P x P`` per intra-head metric, ``P`` the longest
text) and for (cn) the largest single result. The batch's results at each text's real positions are checked
against the text run alone (largest absolute difference of ``contribution``, intra- and inter-head).

    flock /tmp/heavy.lock python benchmarks/bench_padding.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_contribution import measure  # this folder is sys.path[0] when the script runs

LENGTHS = "12,20,32,44,64,80,100,128"
KINDS = ("p1", "pn", "c1", "cn")


def make_texts(model: Any, lengths: list[int]) -> list[str]:
    """One wikitext-2 window per length, cut to that many tokens and decoded (BOS dropped)."""
    from mechgeom.data import load_corpus

    windows = load_corpus("wikitext2", model, n_texts=len(lengths), seq_len=max(lengths) + 1, seed=0)
    bos = getattr(model.tokenizer, "bos_token_id", None)
    texts = []
    for row, n in zip(windows.tolist(), lengths, strict=True):
        ids = [t for t in row if t != bos][:n]
        texts.append(model.tokenizer.decode(ids))
    return texts


def runners(model: Any, texts: list[str]) -> dict[str, Any]:
    """The four measurements as functions of nothing."""
    from mechgeom.analyses.contribution.weights import contribution_weights
    from mechgeom.hooks import run_hooks, to_batch

    batch = to_batch(model, texts)
    alone = [to_batch(model, t) for t in texts]

    def plain_batch() -> None:
        run_hooks(model, batch[0], [], attention_mask=batch[1])

    def plain_each() -> None:
        for tokens, mask in alone:
            run_hooks(model, tokens, [], attention_mask=mask)

    return {
        "p1": plain_batch,
        "pn": plain_each,
        "c1": lambda: contribution_weights(model, texts),
        "cn": lambda: [contribution_weights(model, t) for t in texts],
    }


def check_same(model: Any, texts: list[str], batch_res: Any, each: list[Any]) -> dict[str, float]:
    """Largest absolute difference of ``contribution`` between the batch at each text's real positions and the
    text alone (intra- and inter-head), and the batch's padded length and real share of its ``q x k``."""
    import torch

    from mechgeom.hooks import to_batch

    _, mask = to_batch(model, texts)
    P = int(mask.shape[1]) if mask is not None else int(batch_res.intra["contribution"].shape[-1])
    intra = inter = 0.0
    real_pairs = 0
    for i, res in enumerate(each):
        idx = mask[i].nonzero().flatten() if mask is not None else torch.arange(P)
        real_pairs += len(idx) ** 2
        b = batch_res.intra["contribution"][i][..., idx, :][..., idx]
        bi = batch_res.inter["contribution"][i][..., idx, :][..., idx]
        intra = max(intra, _diff(b, res.intra["contribution"][0]))
        inter = max(inter, _diff(bi, res.inter["contribution"][0]))
    return {
        "max_diff_intra": intra,
        "max_diff_inter": inter,
        "padded_len": P,
        "real_share": real_pairs / (len(texts) * P * P),
    }


def _diff(a: Any, b: Any) -> float:
    """Largest absolute difference; NaN on both sides counts 0, on one side only inf."""
    import torch

    d = (a - b).abs()
    d = torch.where(a.isnan() & b.isnan(), torch.zeros_like(d), d)
    return float(d.nan_to_num(nan=float("inf")).max())


def load(args: argparse.Namespace) -> tuple[Any, list[str]]:
    import torch

    torch.set_num_threads(args.threads)
    from mechgeom import load_model

    model = load_model(args.model)
    if args.padding_side:
        model.tokenizer.padding_side = args.padding_side
    lengths = [int(x) for x in args.lengths.split(",")][: args.n_texts]
    return model, make_texts(model, lengths)


def worker(args: argparse.Namespace) -> None:
    model, texts = load(args)
    fn = runners(model, texts)[args.worker]
    _, mb, out = measure(fn)
    del out
    print("RESULT " + json.dumps({"kind": args.worker, "peak_mb": mb}), flush=True)


def spawn(kind: str, args: argparse.Namespace) -> float:
    """Peak memory growth (MB) of one cold run of ``kind`` in a fresh worker process."""
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(args.threads), "--model", args.model]
    cmd += ["--lengths", args.lengths, "--n-texts", str(args.n_texts)]
    if args.padding_side:
        cmd += ["--padding-side", args.padding_side]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"worker {kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(json.loads(line.removeprefix("RESULT "))["peak_mb"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default=LENGTHS, help="comma-separated token lengths, one text each")
    ap.add_argument("--n-texts", type=int, default=8)
    ap.add_argument(
        "--padding-side", choices=["left", "right"], default=None, help="default: the tokenizer's"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true", help="skip the fresh-worker peak memory runs")
    ap.add_argument("--out", default="results/contribution/smollm2-135m/padding.md")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    model, texts = load(args)
    fns = runners(model, texts)
    first = {kind: fn() for kind, fn in fns.items()}  # warm-up
    same = check_same(model, texts, first["c1"], first["cn"])
    del first
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.repeats):
        for kind, fn in fns.items():
            dt, _, out = measure(fn)
            del out
            times[kind].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = {k: float("nan") for k in KINDS} if args.no_memory else {k: spawn(k, args) for k in KINDS}
    lengths = [int(to.shape[1]) for to in (model.to_tokens(t) for t in texts)]
    side = args.padding_side or model.tokenizer.padding_side
    head = (
        f"Padded batch against one by one on {args.model}, `contribution_weights`, all {model.cfg.n_layers} layers, "
        f"the full family; CPU ({platform.processor() or platform.machine()}), {args.threads} threads, torch "
        f"{torch.__version__}; {len(texts)} texts of {lengths} tokens, padded on the {side} to "
        f"{same['padded_len']} (real pairs: {same['real_share']:.0%} of the batch's q x k); median of "
        f"{args.repeats} interleaved rounds after a warm-up, in one process; peak memory from a fresh worker each."
    )
    rows = [
        "| | (p1) plain forward, batch | (pn) plain forwards, one by one | (c1) contributions, batch "
        "| (cn) contributions, one by one | c1/p1 | cn/pn | cn/c1 | pn/p1 | peak mem p1 / pn / c1 / cn, MB "
        "| batch vs alone, max abs diff (intra, inter) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {len(texts)} texts | {med['p1']:.2f} s | {med['pn']:.2f} s | {med['c1']:.2f} s | {med['cn']:.2f} s "
        f"| {med['c1'] / med['p1']:.2f} | {med['cn'] / med['pn']:.2f} | {med['cn'] / med['c1']:.2f} "
        f"| {med['pn'] / med['p1']:.2f} | {peak['p1']:.0f} / {peak['pn']:.0f} / {peak['c1']:.0f} / {peak['cn']:.0f} "
        f"| {same['max_diff_intra']:.1e}, {same['max_diff_inter']:.1e} |",
    ]
    text = head + "\n\n" + "\n".join(rows) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(json.dumps({"times": times, "peak_mb": peak, **same}))


if __name__ == "__main__":
    main()
