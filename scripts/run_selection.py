"""Token-selection geometry and the Retriever/Mixer/Reset taxonomy (SPEC.md §B) on WikiText-2 windows.

Writes under ``<out>/<model>/``:

- ``selection_heads.csv``: per (layer, head, N) mean F_N of the top-N set, of random N-subsets, without the
  sink, the certificate, the sink-aware bound and its constant-norm prediction
  (:meth:`mechgeom.analyses.selection.SelectionResult.to_frame`);
- ``selection_by_n.csv``: the same averaged over heads, per N (the top-N vs random table);
- ``sink_effect.csv``: per N, over the queries whose I_N holds the sink: F_N with it vs without position 0;
- ``bound_params.csv``: fitted regime parameters per head and whether the regime holds;
- ``bound_by_n.csv``: predicted (guaranteed and constant-norm) vs measured F_N per N, all heads and regime heads;
- ``taxonomy_<corpus>.csv``: per-head labels; ``taxonomy_distribution.csv``, ``taxonomy_regimes.csv``
  (shares and output alignments), ``taxonomy_agreement.csv`` (pairwise between corpora);
- ``summary.json``; figures ``selection_f_vs_n.png`` and ``taxonomy_regimes.png``.

Geometry is measured on the model as loaded (value space, GQA-expanded ``hook_v``); position 0 is the sink
(SmolLM2: the first text token; Gemma: BOS). Run Gemma under the locks:
``flock /tmp/gemma.lock flock /tmp/heavy.lock python scripts/run_selection.py --model gemma-3-270m``.
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
from mechgeom.analyses.selection import SelectionResult, token_selection
from mechgeom.analyses.taxonomy import (
    classify_heads,
    label_agreement,
    label_distribution,
    regime_summary,
)
from mechgeom.data import load_corpus
from mechgeom.viz import plot_regime_grid, save_png


def sink_effect(res: SelectionResult) -> pd.DataFrame:
    """Per N, over the (text, layer, head, query) with a sink in I_N: F_N with the sink vs without it."""
    pq = res.per_query
    rows = []
    for t, n in enumerate(res.ns):
        f, f_ns = pq["f_top"][..., t], pq["f_nosink"][..., t]
        sel = (pq["sink_in_top"][..., t] > 0.5) & ~torch.isnan(f) & ~torch.isnan(f_ns)
        a, b = f[sel].double(), f_ns[sel].double()
        rows.append(
            {
                "N": n,
                "share_sink_in_top": float(sel.sum() / (~torch.isnan(f)).sum()),
                "n_pairs": int(sel.sum()),
                "f_with_sink": float(a.mean()),
                "f_without_sink": float(b.mean()),
                "ratio_of_means": float(a.mean() / b.mean()),
                "share_halved": float((a <= 0.5 * b).double().mean()),
                "share_lower": float((a < b).double().mean()),
            }
        )
    return pd.DataFrame(rows)


def bound_table(df: pd.DataFrame, params: pd.DataFrame) -> pd.DataFrame:
    """Measured F_N vs the guaranteed bound and the constant-norm prediction, all heads and regime heads."""
    merged = df.merge(params[["layer", "head", "regime"]], on=["layer", "head"])
    rows = []
    for scope, part in (("all heads", merged), ("regime heads", merged[merged.regime])):
        for n, g in part.groupby("N"):
            w = g["n_queries"]
            rows.append(
                {
                    "scope": scope,
                    "N": n,
                    "n_heads": len(g),
                    "measured": np.average(g.f_top, weights=w) if w.sum() else np.nan,
                    "bound": np.average(g.bound, weights=w) if w.sum() else np.nan,
                    "bound_ideal": np.average(g.bound_ideal, weights=w) if w.sum() else np.nan,
                    "bound_violations": int(g.bound_violations.sum()),
                    "ideal_violations": int(g.ideal_violations.sum()),
                    "n_queries": int(w.sum()),
                }
            )
    return pd.DataFrame(rows)


def selection_figure(by_n: pd.DataFrame, df: pd.DataFrame, title: str) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    for col, label, style in (
        ("f_top", "top-N", "-o"),
        ("f_random", "random N-subsets", "--o"),
        ("f_nosink", "top-N, sink excluded", "-s"),
        ("bound_ideal", "constant-norm prediction", "-.^"),
        ("bound", "sink-aware bound (guaranteed)", ":v"),
    ):
        ax1.plot(by_n["N"], by_n[col], style, ms=3, label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("N")
    ax1.set_ylabel("mean extreme F-score")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax1.set_title(title, fontsize=9)
    ax2.scatter(df["bound_ideal"], df["f_top"], s=4, c=np.log2(df["N"]), cmap="viridis")
    ax2.plot([0, 1], [0, 1], color="0.5", lw=0.8, ls="--")
    ax2.set_xlabel("constant-norm prediction (per head, N)")
    ax2.set_ylabel("measured mean F_N")
    ax2.set_title("predicted vs measured (colour: log2 N)", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n-texts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default="results/selection")
    p.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--n-random", type=int, default=2, help="random N-subsets per query (the baseline)")
    p.add_argument("--query-stride", type=int, default=1, help="analyse every k-th query (1: all)")
    p.add_argument("--corpora", nargs="+", default=["wikitext2", "c4", "gsm8k"], help="taxonomy corpora")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()

    model = load_model(args.model)
    out = Path(args.out) / args.model
    tokens = load_corpus("wikitext2", model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
    first_tokens = sorted({model.to_string(t[:1]) for t in tokens})
    print(
        f"{args.model}: {tokens.shape[0]} x {tokens.shape[1]} WikiText-2 windows; position 0 = {first_tokens}"
    )

    # ---------------------------------------------------------------- selection geometry
    t0 = time.time()
    res = token_selection(
        model,
        tokens,
        ns=args.ns,
        n_random=args.n_random,
        query_stride=args.query_stride,
        seed=args.seed,
        verbose=True,
    )
    df = res.to_frame()
    params = res.params_frame()
    write_frame(df, out / "selection_heads.csv")
    write_frame(params, out / "bound_params.csv")
    cols = [
        "f_top",
        "f_random",
        "f_gap",
        "f_nosink",
        "sink_in_top",
        "f_top_sink_in",
        "f_nosink_sink_in",
        "certificate",
        "bound",
        "bound_ideal",
    ]
    by_n = df.groupby("N")[cols].mean()
    by_n[["cert_violations", "bound_violations", "ideal_violations"]] = df.groupby("N")[
        ["cert_violations", "bound_violations", "ideal_violations"]
    ].sum()
    by_n = by_n.reset_index()
    write_frame(by_n, out / "selection_by_n.csv")
    sinks = sink_effect(res)
    write_frame(sinks, out / "sink_effect.csv")
    bounds = bound_table(df, params)
    write_frame(bounds, out / "bound_by_n.csv")
    save_png(selection_figure(by_n, df, f"{args.model}: extreme F-score vs N"), out / "selection_f_vs_n.png")
    print(f"selection: {time.time() - t0:.0f} s")
    print(by_n.to_string(index=False, float_format="%.4f"))
    print(sinks.to_string(index=False, float_format="%.4f"))
    print(bounds.to_string(index=False, float_format="%.4f"))

    # ---------------------------------------------------------------- taxonomy
    t0 = time.time()
    tables: dict[str, pd.DataFrame] = {}
    for corpus in args.corpora:
        toks = (
            tokens
            if corpus == "wikitext2"
            else load_corpus(corpus, model, n_texts=args.n_texts, seq_len=args.seq_len, seed=args.seed)
        )
        table = classify_heads(
            model, toks, batch_size=args.batch_size, corpus=corpus, verbose=True
        ).to_frame()
        tables[corpus] = table
        write_frame(table, out / f"taxonomy_{corpus}.csv")
    all_tables = pd.concat(tables.values(), ignore_index=True)
    dist = label_distribution(all_tables, by="corpus")
    write_frame(dist, out / "taxonomy_distribution.csv")
    regimes = pd.concat([regime_summary(t).assign(corpus=c) for c, t in tables.items()], ignore_index=True)
    write_frame(regimes, out / "taxonomy_regimes.csv")
    agreement: dict[str, Any] = {}
    if len(tables) >= 2:
        agr = label_agreement(tables)
        write_frame(agr.pairwise, out / "taxonomy_agreement.csv")
        agreement = {"pairwise": agr.pairwise.to_dict(orient="records"), "all_agree": agr.all_agree}
        for (a, b), conf in agr.confusion.items():
            print(f"confusion {a} (rows) vs {b} (columns):\n{conf.to_string()}")
    ref = tables.get("wikitext2", next(iter(tables.values())))
    save_png(
        plot_regime_grid(ref, title=f"{args.model}, {ref['corpus'].iloc[0]}: head regimes"),
        out / "taxonomy_regimes.png",
    )
    print(f"taxonomy: {time.time() - t0:.0f} s")
    print(dist.to_string(index=False, float_format="%.4f"))
    print(regimes.to_string(index=False, float_format="%.4f"))
    if agreement:
        print(
            pd.DataFrame(agreement["pairwise"]).to_string(index=False),
            f"all agree: {agreement['all_agree']:.4f}",
        )

    # ---------------------------------------------------------------- summary
    gap = by_n.set_index("N")["f_gap"]
    shares = dist.pivot(index="corpus", columns="label", values="share")
    summary = {
        "model": args.model,
        "windows": [int(tokens.shape[0]), int(tokens.shape[1])],
        "position_0_tokens": first_tokens,
        "basis": "value space (hook_v, GQA-expanded), model as loaded",
        "n_random": args.n_random,
        "query_stride": args.query_stride,
        "largest_mean_gap": {
            "N": int(gap.idxmax()),
            "f_top": float(by_n.set_index("N").loc[gap.idxmax(), "f_top"]),
            "f_random": float(by_n.set_index("N").loc[gap.idxmax(), "f_random"]),
            "gap": float(gap.max()),
        },
        "largest_head_gap": df.loc[
            df.f_gap.idxmax(), ["layer", "head", "N", "f_top", "f_random", "f_gap"]
        ].to_dict(),
        "sink_effect": sinks.to_dict(orient="records"),
        "violations": {
            "certificate": int(df.cert_violations.sum()),
            "bound": int(df.bound_violations.sum()),
            "bound_ideal": int(df.ideal_violations.sum()),
            "bound_ideal_share_of_queries": float(df.ideal_violations.sum() / df.n_queries.sum()),
        },
        "regime_flags_share_of_heads": {
            k: float(params[k].mean()) for k in ("sink_small", "sink_opposed", "near_constant", "regime")
        },
        "bound_params_median": params[["nu", "rho", "kappa", "kappa_mean", "mu", "mu_mean"]]
        .median()
        .to_dict(),
        "bound_by_n": bounds.to_dict(orient="records"),
        "regime_shares": shares.to_dict(orient="index"),
        "retriever_share": {c: float(shares.loc[c, "Retriever"]) for c in shares.index},
        "alignment": regimes[["corpus", "label", "cos_out_sink", "cos_out_cur", "sink_rate"]].to_dict(
            orient="records"
        ),
        "agreement": agreement,
        "seconds": round(time.time() - t_start),
    }
    with atomic_write(out / "summary.json") as f:
        json.dump(summary, f, indent=1, default=float)
    for k in (
        "largest_mean_gap",
        "largest_head_gap",
        "violations",
        "regime_flags_share_of_heads",
        "retriever_share",
    ):
        print(f"{k}: {json.dumps(summary[k], default=float)}")
    print(f"total: {summary['seconds']} s; wrote {out}")


if __name__ == "__main__":
    main()
