"""Brute-force references shared by the unit tests (explicit loops over materialised tensors), one place for
each: sink statistics (``test_sinks_unit``), rollout (``test_rollout_unit``), taxonomy winners
(``test_taxonomy_unit``), token selection (``test_selection_unit``); the family matrix
(``test_families_unit``) runs them on every family. The contribution reference is
``reference_contribution.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from mechgeom.hooks import hook_name

# --------------------------------------------------------------------------- sink statistics


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def sink_reference(model, tokens, sinks):
    """Every sink statistic by explicit Python loops over layers, texts, heads, queries and sources."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    cfg = model.cfg
    n_heads = cfg.n_heads
    group = n_heads // (cfg.n_key_value_heads or n_heads)
    n_texts, pos = tokens.shape
    nonsink = [j for j in range(pos) if j not in sinks]
    queries = [i for i in range(pos) if i > max(sinks)]
    nan = float("nan")
    out = {
        k: {} for k in ("rate", "rate_pos", "ratio_v", "ratio_vt", "cos_tok", "cos_mean", "query", "entries")
    }
    for layer in range(cfg.n_layers):
        pattern = cache[hook_name(layer, "pattern")].double()
        v = cache[hook_name(layer, "v")].double()
        z = cache[hook_name(layer, "z")].double()
        W_O = model.W_O[layer].detach().double()
        for h in range(n_heads):
            out["entries"][(layer, h)] = {"sink": [], "tail": []}
            for b in range(n_texts):
                vt = [v[b, j, h // group] @ W_O[h] for j in range(pos)]
                vn = [float(v[b, j, h // group].norm()) for j in range(pos)]
                o = [z[b, i, h] @ W_O[h] for i in range(pos)]
                alpha = pattern[b, h]
                key = (b, layer, h)
                out["rate"][key] = (
                    np.mean([sum(float(alpha[i, s]) for s in sinks) for i in queries]) if queries else nan
                )
                for s in sinks:
                    k2 = (*key, s)
                    out["rate_pos"][k2] = np.mean([float(alpha[i, s]) for i in queries]) if queries else nan
                    if nonsink:
                        out["ratio_v"][k2] = vn[s] / np.mean([vn[j] for j in nonsink])
                        out["ratio_vt"][k2] = float(vt[s].norm()) / np.mean(
                            [float(vt[j].norm()) for j in nonsink]
                        )
                        out["cos_tok"][k2] = np.mean([cosine(vt[s], vt[j]) for j in nonsink])
                    else:
                        out["ratio_v"][k2] = out["ratio_vt"][k2] = out["cos_tok"][k2] = nan
                cos_q = []
                for i in queries:
                    ms = sum(float(alpha[i, s]) for s in sinks)
                    mr = sum(float(alpha[i, j]) for j in nonsink if j <= i)
                    vs = sum(alpha[i, s] * vt[s] for s in sinks) / ms
                    m = sum(alpha[i, j] * vt[j] for j in nonsink if j <= i) / mr
                    a, c, x = float(vs @ vs), float(m @ m), float(vs @ m)
                    s_star = (c - x) / (a - 2 * x + c)
                    out["query"][(*key, i)] = (ms, a, x, c, s_star, float(o[i].norm()))
                    cos_q.append(x / math.sqrt(a * c))
                    for j in range(i + 1):
                        cval = float(o[i] @ (alpha[i, j] * vt[j]) / (o[i] @ o[i]))
                        ratio = float(vt[j].norm() / o[i].norm())
                        cosv = cosine(o[i], vt[j])
                        assert cval == pytest.approx(float(alpha[i, j]) * ratio * cosv, rel=1e-9)
                        if float(alpha[i, j]) == 0 or cosv == 0:  # §4.3: a log that is not finite: dropped
                            continue
                        row = (
                            math.log(alpha[i, j]),
                            math.log(ratio),
                            math.log(abs(cosv)),
                            math.log(abs(cval)),
                        )
                        out["entries"][(layer, h)]["sink" if j in sinks else "tail"].append(row)
                cos_q = [c for c in cos_q if not math.isnan(c)]  # a query with no sink mass: skipped (§4)
                out["cos_mean"][key] = np.mean(cos_q) if cos_q else nan
    return out


def ref_shares(rows):
    x = np.array(rows)
    if len(x) < 2:
        return np.full(3, np.nan), np.full(3, np.nan) if len(x) == 0 else x[:, :3].mean(0)
    big_l = x[:, 3]
    cov = [np.mean((x[:, f] - x[:, f].mean()) * (big_l - big_l.mean())) for f in range(3)]
    return np.array(cov) / big_l.var(), x[:, :3].mean(0)


def close(a, b, tol=2e-5):
    a, b = float(a), float(b)
    if math.isnan(b):
        return math.isnan(a)
    return abs(a - b) <= tol * (1 + abs(b))


def check_sink_statistics(
    res: Any,
    ref: dict,
    *,
    n_layers: int,
    n_heads: int,
    n_texts: int,
    pos: int,
    sinks: list[int],
    massless_norm: bool = True,
) -> None:
    """Every statistic of a ``SinkResult`` against :func:`sink_reference` of the same model, tokens and sinks:
    rates, norm ratios, cosines, the per-query convexity terms (NaN outside the queries) and the factor
    shares and means of the sink and tail entries. ``massless_norm=False`` leaves out ``head_out_norm()`` at
    queries whose sink mass is 0 (a sliding window past the sink: ``test_families_unit`` xfails it)."""
    s_star = res.s_star()
    shares, means, counts = res.factor_shares()
    for layer in range(n_layers):
        for h in range(n_heads):
            for b in range(n_texts):
                key = (b, layer, h)
                assert close(res.sink_rate[b, layer, h], ref["rate"][key])
                assert close(res.cos_sink_mean[b, layer, h], ref["cos_mean"][key], 1e-4)
                for si, s in enumerate(sinks):
                    k2 = (*key, s)
                    assert close(res.sink_rate_pos[b, layer, h, si], ref["rate_pos"][k2])
                    assert close(res.norm_ratio_v[b, layer, h, si], ref["ratio_v"][k2])
                    assert close(res.norm_ratio_vt[b, layer, h, si], ref["ratio_vt"][k2])
                    assert close(res.cos_sink_tokens[b, layer, h, si], ref["cos_tok"][k2], 1e-4)
                for i in range(pos):
                    got = (res.sink_mass, res.sq_sink, res.cross, res.sq_mean, s_star, res.head_out_norm())
                    if (*key, i) not in ref["query"]:
                        assert all(math.isnan(float(t[b, layer, h, i])) for t in got)
                        continue
                    want_row = ref["query"][(*key, i)]
                    if not massless_norm and want_row[0] == 0:
                        got, want_row = got[:-1], want_row[:-1]
                    for t, want in zip(got, want_row, strict=True):
                        assert close(t[b, layer, h, i], want, 1e-4)
            for g, gname in enumerate(("sink", "tail")):
                rows = ref["entries"][(layer, h)][gname]
                want_shares, want_means = ref_shares(rows)
                assert int(counts[layer, h, g]) == len(rows)
                np.testing.assert_allclose(shares[layer, h, g].numpy(), want_shares, atol=2e-4, rtol=1e-3)
                np.testing.assert_allclose(means[layer, h, g].numpy(), want_means, atol=1e-4, rtol=1e-4)
                assert float(shares[layer, h, g].sum()) == pytest.approx(1.0, abs=1e-4)


# --------------------------------------------------------------------------- rollout


def brute_rollout(patterns: list[torch.Tensor], layer: int, b: int) -> torch.Tensor:
    """``R_{layer-1}`` of text ``b`` from the patterns ``[batch, head, q, k]`` of every layer, in float64."""
    q = patterns[0].shape[-1]
    r = torch.eye(q, dtype=torch.float64)
    for la in range(layer):
        p = patterns[la][b].double()
        a = torch.zeros(q, q, dtype=torch.float64)
        for i in range(q):
            for j in range(q):
                a[i, j] = 0.5 * p[:, i, j].mean() + (0.5 if i == j else 0.0)
            a[i] = a[i] / a[i].sum()
        r = a @ r
    return r


def patterns_of(model, tokens, extra=()) -> list[torch.Tensor]:
    names = [f"blocks.{la}.attn.hook_pattern" for la in range(model.cfg.n_layers)]
    with model.hooks(fwd_hooks=list(extra)):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return [cache[n].detach() for n in names]


# --------------------------------------------------------------------------- taxonomy


def brute_winners(pat: torch.Tensor, v: torch.Tensor) -> list[list[list[int]]]:
    b, h, _, k = pat.shape
    out = []
    for bi in range(b):
        rows = []
        for hi in range(h):
            ws = []
            for i in range(k):
                scores = [float(pat[bi, hi, i, j]) * float(v[bi, j, hi].norm()) for j in range(i + 1)]
                best = max(scores)
                ws.append(next(j for j, s in enumerate(scores) if s == best))  # first = lowest position
            rows.append(ws)
        out.append(rows)
    return out


# --------------------------------------------------------------------------- token selection


def brute_top(a: list[float], cands: list[int], n: int) -> list[int]:
    return sorted(cands, key=lambda j: (-a[j], j))[:n]


def brute_f(d: dict[int, float], members: set[int]) -> float:
    """max over every radius (and the empty ball) of 2PR/(P+R), by explicit loops."""
    n = len(members)
    best = 0.0
    for r in [-1.0, *d.values()]:
        ball = [j for j in d if d[j] <= r]
        tp = sum(1 for j in ball if j in members)
        if tp == 0:
            continue
        p, rec = tp / len(ball), tp / n
        best = max(best, 2 * p * rec / (p + rec))
    return best


def brute_mq(d: dict[int, float], members: set[int]) -> tuple[int, int]:
    max_in = max(d[j] for j in members)
    outs = [d[k] for k in d if k not in members]
    min_out = min(outs) if outs else math.inf
    m = sum(1 for k in d if k not in members and d[k] <= max_in)
    q = sum(1 for j in members if d[j] < min_out)
    return m, q


def brute_distances(
    a: torch.Tensor, vals: torch.Tensor, members: list[int], cands: list[int]
) -> dict[int, float]:
    """d_j = ‖a_j v_j − sum_{I} a_l v_l‖ with materialised vectors."""
    s = sum(a[j] * vals[j] for j in members)
    return {j: float((a[j] * vals[j] - s).norm()) for j in cands}


def check_selection(
    out: dict[str, torch.Tensor], pat: torch.Tensor, v: torch.Tensor, ns: list[int], sinks: tuple[int, ...]
) -> None:
    """``layer_selection``'s per-query ``f_top``, ``f_nosink``, certificate, ``sink_in_top`` and bound of
    every text, head, query and ``N`` of ``ns`` against :func:`brute_f` over materialised distances.

    ``pat [b h q k]`` and ``v [b k h d]`` (GQA-expanded) are what ``layer_selection`` was given.
    """
    b, h, k = pat.shape[0], pat.shape[1], pat.shape[-1]
    for bi in range(b):
        for hi in range(h):
            a = pat[bi, hi]
            for i in range(k):
                for t, n in enumerate(ns):
                    for name, cands in (
                        ("f_top", list(range(i + 1))),
                        ("f_nosink", [j for j in range(i + 1) if j not in sinks]),
                    ):
                        got = out[name][bi, hi, i, t].item()
                        if len(cands) < n:  # documented: too few sources -> NaN
                            assert math.isnan(got)
                            continue
                        top = brute_top(a[i].tolist(), cands, n)
                        dd = brute_distances(a[i], v[bi, :, hi], top, cands)
                        assert got == pytest.approx(brute_f(dd, set(top)), abs=1e-6)
                        if len(cands) == n:
                            assert got == 1.0
                        if name == "f_top":
                            m, q = brute_mq(dd, set(top))
                            cert = max(2 * n / (2 * n + m), 2 * q / (n + q))
                            assert out["certificate"][bi, hi, i, t].item() == pytest.approx(cert, abs=1e-6)
                            assert out["certificate"][bi, hi, i, t] <= got
                            assert out["sink_in_top"][bi, hi, i, t].item() == float(
                                any(s in top for s in sinks)
                            )
                            assert out["bound"][bi, hi, i, t] <= got
