"""Attention sinks on WikiText-2 windows: statistics, convexity, factor decomposition, sink-value ablation.

Writes under ``<out>/<model>/``:

- ``heads.csv``: per (layer, head, sink) statistics (:meth:`mechgeom.analyses.sinks.SinkResult.to_frame`);
- ``convexity_check.csv``: closed-form vs intervention ``‖o(s)‖`` for a few heads;
- ``ablation_all_layers_<mode>.csv``: per-head changes when the sink value is ablated in every layer and head;
- ``ablation_summary.csv``: one row per ablation (all layers, then each layer alone) with ΔPPL and controls;
- ``summary.json``: the headline numbers; figures ``rate_vs_ratio.png``, ``convexity_curves.png``,
  ``s_star_vs_rate.png``, ``cone_shift.png``.

Run Gemma under the locks: ``flock /tmp/gemma.lock flock /tmp/heavy.lock python scripts/run_sinks.py --model gemma-3-270m``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom import load_model
from mechgeom._io import atomic_write, write_frame
from mechgeom._progress import progress
from mechgeom.analyses.sinks import (
    SinkResult,
    convexity_by_intervention,
    sink_ablation,
    sink_statistics,
)
from mechgeom.data import load_corpus
from mechgeom.viz import (
    plot_cone_shift,
    plot_convexity_curves,
    plot_rate_vs_ratio,
    plot_sink_rate_vs_s_star,
    save_png,
)


def _describe(x: pd.Series) -> dict[str, float]:
    x = x.dropna()
    q = np.quantile(x, [0.0, 0.05, 0.5, 0.95, 1.0]) if len(x) else [np.nan] * 5
    return {"min": q[0], "p05": q[1], "median": q[2], "p95": q[3], "max": q[4], "n": len(x)}


def _pick_heads(stats: SinkResult, k: int = 3) -> list[tuple[int, int]]:
    """A strong sink head, a median one and a weak one, from the middle layers."""
    df = stats.to_frame().drop_duplicates(["layer", "head"])
    df = df[df["layer"] >= 1].sort_values("sink_rate")
    idx = np.linspace(len(df) - 1, 0, k).round().astype(int)
    return [(int(df.iloc[i]["layer"]), int(df.iloc[i]["head"])) for i in idx]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n-texts", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out", default="results/sinks")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=["zero", "mean_norm"], help="all-layer ablation modes")
    p.add_argument("--per-layer-texts", type=int, default=8, help="windows for the per-layer sweep (0: skip)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()

    model = load_model(args.model)
    out = Path(args.out) / args.model
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    first_tok = model.to_str_tokens(tokens[0, :1])[0]
    print(
        f"{args.model}: {tokens.shape[0]} windows x {tokens.shape[1]} tokens; position 0 of text 0 = {first_tok!r}"
    )

    # ---- statistics, convexity, factor decomposition
    t0 = time.time()
    stats = sink_statistics(model, tokens, batch_size=args.batch_size, verbose=True)
    heads = stats.to_frame()
    write_frame(heads, out / "heads.csv")
    print(f"statistics: {time.time() - t0:.0f} s")

    summary: dict[str, Any] = {
        "model": args.model,
        "n_texts": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "corpus": f"wikitext2 (test), seed {args.seed}",
        "sink_positions": stats.sink_positions,
        "position0_is_bos": bool(getattr(model.cfg, "default_prepend_bos", False)),
        "basis": stats.basis,
    }
    sink_heads = heads[heads["sink_rate"] >= 0.5]
    for name, df in (
        ("all_heads", heads),
        ("sink_heads", sink_heads),
        ("layers_ge1", heads[heads["layer"] >= 1]),
    ):
        summary[f"norm_ratio_v_{name}"] = _describe(df["norm_ratio_v"])
        summary[f"norm_ratio_vt_{name}"] = _describe(df["norm_ratio_vt"])
        summary[f"share_ratio_vt_in_0.1_0.33_{name}"] = float(df["norm_ratio_vt"].between(0.1, 1 / 3).mean())
        summary[f"share_ratio_vt_below_1_{name}"] = float((df["norm_ratio_vt"] < 1).mean())
        summary[f"cos_sink_tokens_{name}"] = _describe(df["cos_sink_tokens"])
        summary[f"share_cos_sink_tokens_negative_{name}"] = float((df["cos_sink_tokens"] < 0).mean())
        summary[f"cos_sink_mean_{name}"] = _describe(df["cos_sink_mean"])
        summary[f"share_cos_sink_mean_negative_{name}"] = float((df["cos_sink_mean"] < 0).mean())
    summary["n_sink_heads"] = len(sink_heads)
    summary["n_heads"] = len(heads)
    summary["interior_share_pooled"] = float(stats.interior_share(pooled=True))
    summary["interior_share_per_head"] = _describe(heads["interior_share"])
    summary["sink_rate_per_head"] = _describe(heads["sink_rate"])
    summary["s_star_median_per_head"] = _describe(heads["s_star_median"])
    summary["sink_rate_minus_s_star_per_head"] = _describe(heads["sink_rate_minus_s_star"])
    summary["corr_sink_rate_s_star_heads"] = float(heads[["sink_rate", "s_star_median"]].corr().iloc[0, 1])
    summary["norm_excess_median_per_head"] = _describe(heads["norm_excess_median"])
    shares, means, _ = stats.factor_shares(pooled=True)
    for g, gname in enumerate(("sink", "tail")):
        summary[f"factor_shares_{gname}_pooled"] = dict(
            zip(("alpha", "ratio", "cos"), shares[g].tolist(), strict=True)
        )
        summary[f"factor_mean_log_{gname}_pooled"] = dict(
            zip(("alpha", "ratio", "cos"), means[g].tolist(), strict=True)
        )
        for f in ("alpha", "ratio", "cos"):
            summary[f"factor_share_{gname}_{f}_per_head"] = _describe(heads[f"{gname}_share_{f}"])

    save_png(plot_rate_vs_ratio(stats, space="vt"), out / "rate_vs_ratio.png")
    save_png(plot_sink_rate_vs_s_star(stats), out / "s_star_vs_rate.png")

    # ---- convexity by intervention on a few heads (2 texts)
    t0 = time.time()
    chosen = _pick_heads(stats)
    grid = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    sub = tokens[:2]
    sub_stats = sink_statistics(model, sub, layers=sorted({la for la, _ in chosen}))
    closed = sub_stats.norm_curve(grid)  # [n layer head q grid]
    rows, measured = [], {}
    for layer, head in chosen:
        meas = convexity_by_intervention(model, sub, grid, layer=layer, heads=head)  # [grid b h q]
        ref = closed[:, sub_stats.layer_index(layer), head].permute(2, 0, 1)  # [grid b q]
        err = (meas[:, :, head] - ref).abs()
        measured[(layer, head)] = (grid, meas[:, 0, head])
        for k, s in enumerate(grid):
            rows.append(
                {"layer": layer, "head": head, "s": s, "max_abs_err": float(err[k].nan_to_num(0).max())}
            )
    conv = pd.DataFrame(rows)
    write_frame(conv, out / "convexity_check.csv")
    summary["convexity_check_heads"] = [list(h) for h in chosen]
    summary["convexity_check_max_abs_err"] = float(conv["max_abs_err"].max())
    save_png(plot_convexity_curves(sub_stats, chosen, measured=measured), out / "convexity_curves.png")
    print(
        f"convexity check: {time.time() - t0:.0f} s, max |closed - measured| = {conv['max_abs_err'].max():.2e}"
    )

    # ---- sink-value ablation: all layers and heads at once
    t0 = time.time()
    summary_rows = []
    clean = None
    for mode in args.modes:
        res = sink_ablation(
            model, tokens, mode=mode, seed=args.seed, batch_size=args.batch_size, clean=clean, verbose=True
        )
        clean = res
        write_frame(res.to_frame(), out / f"ablation_all_layers_{mode}.csv")
        summary_rows.append({"scope": "all layers", **res.summary(seed=args.seed)})
        if mode == args.modes[0]:
            save_png(plot_cone_shift(res), out / "cone_shift.png")
    print(f"all-layer ablations: {time.time() - t0:.0f} s")

    # ---- per-layer sweep (zero mode) on the first --per-layer-texts windows
    if args.per_layer_texts > 0:
        t0 = time.time()
        few = tokens[: args.per_layer_texts]
        clean_few = None
        for layer in progress(range(model.cfg.n_layers), desc="per-layer ablation"):
            res = sink_ablation(
                model,
                few,
                layers=layer,
                mode="zero",
                seed=args.seed,
                batch_size=args.batch_size,
                clean=clean_few,
            )
            clean_few = res
            summary_rows.append({"scope": f"layer {layer}", **res.summary(seed=args.seed)})
        print(f"per-layer ablations: {time.time() - t0:.0f} s")
    abl = pd.DataFrame(summary_rows)
    write_frame(abl, out / "ablation_summary.csv")
    summary["ablation"] = abl.to_dict(orient="records")
    summary["runtime_s"] = round(time.time() - t_start, 1)
    with atomic_write(out / "summary.json") as f:
        json.dump(summary, f, indent=1, default=float)

    cols = ["scope", "mode", "n_texts", "ppl_clean", "dppl_sink", "dppl_control", "dnll_sink", "dnll_control"]
    with pd.option_context("display.width", 160, "display.max_rows", 100):
        print(abl[cols].to_string(index=False, float_format="%.4g"))
    keys = [
        "norm_ratio_v_all_heads",
        "norm_ratio_vt_all_heads",
        "norm_ratio_vt_sink_heads",
        "share_ratio_vt_below_1_all_heads",
        "share_ratio_vt_in_0.1_0.33_all_heads",
        "cos_sink_tokens_all_heads",
        "share_cos_sink_tokens_negative_all_heads",
        "cos_sink_mean_all_heads",
        "interior_share_pooled",
        "sink_rate_minus_s_star_per_head",
        "corr_sink_rate_s_star_heads",
        "factor_shares_sink_pooled",
        "factor_shares_tail_pooled",
        "convexity_check_max_abs_err",
        "runtime_s",
    ]
    for k in keys:
        print(f"{k}: {json.dumps(summary[k], default=float)}")


if __name__ == "__main__":
    main()
