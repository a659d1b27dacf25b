"""Token-selection geometry (``docs/definitions.md`` §5) against brute-force references built here."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext
from fractions import Fraction

import pytest
import torch
from conftest import make_tiny, random_tokens
from hypothesis import given, settings, strategies as st
from refs import brute_distances, brute_f, brute_mq, brute_top, check_selection

from mechgeom.analyses.selection import BoundParams, bound_radii, precision_recall_curve
from mechgeom.analyses.selection.collector import (
    PER_QUERY,
    candidate_mask,
    extreme_f_score,
    fit_bound_params,
    inversion_certificate,
    layer_selection,
    random_ranks,
    selection_distances,
    sink_aware_bound,
    source_ranks,
    token_selection,
    token_selection_from_cache,
)
from mechgeom.hooks import expand_kv, has_hooks

F64 = torch.float64


# --------------------------------------------------------------------------- brute-force references


def causal_pattern(
    b: int, h: int, k: int, seed: int, scale: float = 2.0, sink_boost: float = 0.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, h, k, k, generator=g, dtype=F64) * scale
    logits[..., 0] += sink_boost
    mask = torch.ones(k, k, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


# --------------------------------------------------------------------------- F-score and certificate


def test_extreme_f_score_equals_max_over_all_radii() -> None:
    g = torch.Generator().manual_seed(0)
    rows, k = 400, 12
    # coarse distances so that ties are frequent
    d = torch.randint(0, 6, (rows, k), generator=g).to(F64) / 2
    valid = torch.rand(rows, k, generator=g) < 0.8
    members = (torch.rand(rows, k, generator=g) < 0.35) & valid
    members[:, 0] = valid[:, 0] = True  # at least one member per row
    f = extreme_f_score(d, members, valid)
    radius, prec, rec = precision_recall_curve(d, members, valid)
    for r in range(rows):
        dd = {j: float(d[r, j]) for j in range(k) if valid[r, j]}
        mem = {j for j in dd if members[r, j]}
        assert f[r].item() == pytest.approx(brute_f(dd, mem), abs=1e-12)
        # the curve lists each distinct radius once, with P and R of the ball at that radius
        ok = ~torch.isnan(radius[r])
        assert sorted(radius[r][ok].tolist()) == sorted(set(dd.values()))
        for rad, p, rc in zip(radius[r][ok].tolist(), prec[r][ok].tolist(), rec[r][ok].tolist(), strict=True):
            ball = [j for j in dd if dd[j] <= rad]
            tp = sum(1 for j in ball if j in mem)
            assert p == pytest.approx(tp / len(ball)) and rc == pytest.approx(tp / len(mem))
        fs = [
            2 * p * rc / (p + rc)
            for p, rc in zip(prec[r][ok].tolist(), rec[r][ok].tolist(), strict=True)
            if p + rc > 0
        ]
        assert max(fs, default=0.0) == pytest.approx(f[r].item())


def test_ties_in_distance_enter_the_ball_together() -> None:
    # members {0, 1}; source 2 ties with member 1: a radius can't take 1 without 2
    d = torch.tensor([[0.0, 1.0, 1.0, 3.0]], dtype=F64)
    members = torch.tensor([[True, True, False, False]])
    valid = torch.ones_like(members)
    # radius 0: P=1, R=1/2 -> 2/3; radius 1: tp=2, |B|=3 -> 0.8
    assert extreme_f_score(d, members, valid).item() == pytest.approx(0.8)
    cert, m, q = inversion_certificate(d, members, valid)
    assert (m.item(), q.item()) == (1, 1)
    assert cert.item() == pytest.approx(max(4 / 5, 2 / 3))


def test_empty_member_set_is_nan() -> None:
    d = torch.zeros(1, 3, dtype=F64)
    none = torch.zeros(1, 3, dtype=torch.bool)
    assert torch.isnan(extreme_f_score(d, none, torch.ones_like(none))).all()
    assert torch.isnan(inversion_certificate(d, none, torch.ones_like(none))[0]).all()


@settings(max_examples=100, deadline=None)
@given(
    k=st.integers(2, 9),
    d_head=st.integers(1, 4),
    n=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    scale=st.floats(0.1, 6.0),
)
def test_certificate_never_exceeds_f_property(k: int, d_head: int, n: int, seed: int, scale: float) -> None:
    pat = causal_pattern(1, 2, k, seed, scale=scale)
    v = torch.randn(1, k, 2, d_head, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    cand = candidate_mask(k)
    mem = (source_ranks(pat, cand) < n) & cand
    d = selection_distances(pat, v, mem)
    f = extreme_f_score(d, mem, cand)
    cert, m, q = inversion_certificate(d, mem, cand)
    for h in range(2):
        for i in range(k):
            dd = {j: float(d[0, h, i, j]) for j in range(i + 1)}
            mset = {j for j in range(i + 1) if mem[0, h, i, j]}
            assert len(mset) == min(n, i + 1)
            assert cert[0, h, i] <= f[0, h, i] + 1e-12
            assert (m[0, h, i].item(), q[0, h, i].item()) == brute_mq(dd, mset)
            # distances agree with materialised vectors, and F with the loop over radii
            ref = brute_distances(pat[0, h, i], v[0, :, h], sorted(mset), list(range(i + 1)))
            for j in ref:  # the Gram trick resolves d² to ~eps·‖s‖², so d near 0 to ~sqrt(eps)
                assert dd[j] == pytest.approx(ref[j], abs=1e-7)
            assert f[0, h, i].item() == pytest.approx(brute_f(ref, mset), abs=1e-9)


# --------------------------------------------------------------------------- ranking and the sweep


def test_top_n_ties_prefer_lower_positions() -> None:
    pat = torch.tensor([[[[0.1, 0.3, 0.3, 0.0, 0.3]]]], dtype=F64)
    cand = torch.ones(1, 5, dtype=torch.bool)
    ranks = source_ranks(pat, cand)
    assert ranks[0, 0, 0].tolist() == [3, 0, 1, 4, 2]
    # uniform attention: I_N is the first N positions, so the sink is always in I_N
    k = 6
    uni = torch.ones(1, 1, k, k, dtype=F64).tril()
    uni = uni / uni.sum(-1, keepdim=True)
    out = layer_selection(uni, torch.randn(1, k, 1, 3, dtype=F64), ns=[2], n_random=0, bound=False, dtype=F64)
    mem = (source_ranks(uni, candidate_mask(k)) < 2) & candidate_mask(k)
    assert mem[0, 0, 5].nonzero().flatten().tolist() == [0, 1]
    assert torch.equal(out["per_query"]["sink_in_top"][0, 0, 1:, 0], torch.ones(k - 1))


@pytest.mark.parametrize("sinks", [(0,), (0, 2)])
def test_layer_selection_matches_bruteforce(sinks: tuple[int, ...]) -> None:
    b, h, k, dh, ns = 2, 2, 7, 3, [1, 2, 3, 8]
    pat = causal_pattern(b, h, k, seed=3, sink_boost=1.0)
    v = torch.randn(b, k, h, dh, generator=torch.Generator().manual_seed(4), dtype=F64)
    out = layer_selection(pat, v, ns=ns, sink_positions=sinks, n_random=0, dtype=F64)["per_query"]
    assert set(out) == set(PER_QUERY)
    check_selection(out, pat, v, ns, sinks)


def test_n_larger_than_sources_is_nan_and_excluded_from_means() -> None:
    model = make_tiny(n_layers=1, attn_only=True)
    res = token_selection(model, random_tokens(1, 6), ns=[4, 6, 7], n_random=1, dtype=F64)
    f = res.per_query["f_top"][0, 0]  # [head, q, n]
    assert torch.isnan(f[:, :3, 0]).all() and not torch.isnan(f[:, 3:, 0]).any()
    assert torch.isnan(f[:, :5, 1]).all() and (f[:, 5, 1] == 1).all()  # N = i + 1: F = 1
    assert torch.isnan(f[..., 2]).all()
    frame = res.to_frame()
    assert frame.loc[frame.N == 4, "n_queries"].tolist() == [3] * 4
    assert frame.loc[frame.N == 7, "n_queries"].tolist() == [0] * 4
    row = frame[(frame.N == 4) & (frame["head"] == 1)].iloc[0]
    assert row.f_top == pytest.approx(f[1, 3:, 0].double().mean().item(), abs=1e-6)


def test_random_subsets_are_uniform_and_reproducible() -> None:
    k, rows = 6, 6000
    cand = candidate_mask(k)
    ranks = random_ranks((rows, 1, k, k), cand, torch.Generator().manual_seed(0))
    mem = (ranks < 2) & cand
    assert (mem.sum(-1)[:, 0, 1:] == 2).all() and not (mem & ~cand).any()
    freq = mem[:, 0, 5].double().mean(0)  # query 5: 6 candidates, each in with probability 1/3
    assert torch.allclose(freq, torch.full((k,), 1 / 3, dtype=F64), atol=0.03)
    freq3 = mem[:, 0, 3, :4].double().mean(0)
    assert torch.allclose(freq3, torch.full((4,), 0.5, dtype=F64), atol=0.03)


def test_random_baseline_is_the_mean_over_seeded_draws() -> None:
    b, h, k, dh, n_random, seed = 1, 2, 8, 3, 3, 11
    pat = causal_pattern(b, h, k, seed=5)
    v = torch.randn(b, k, h, dh, generator=torch.Generator().manual_seed(6), dtype=F64)
    out = layer_selection(pat, v, ns=[2, 3], n_random=n_random, seed=seed, bound=False, dtype=F64)[
        "per_query"
    ]
    again = layer_selection(pat, v, ns=[2, 3], n_random=n_random, seed=seed, bound=False, dtype=F64)[
        "per_query"
    ]
    other = layer_selection(pat, v, ns=[2, 3], n_random=n_random, seed=seed + 1, bound=False, dtype=F64)[
        "per_query"
    ]
    assert torch.allclose(out["f_random"], again["f_random"], equal_nan=True)
    assert not torch.allclose(out["f_random"], other["f_random"], equal_nan=True)
    # replay the draws: same generator, same calls, then brute force
    gen = torch.Generator().manual_seed(seed)
    cand = candidate_mask(k)
    draws = [random_ranks(pat.shape, cand, gen) for _ in range(n_random)]
    for hi in range(h):
        for i in range(1, k):
            for t, n in enumerate([2, 3]):
                if i + 1 < n:
                    assert math.isnan(out["f_random"][0, hi, i, t].item())
                    continue
                vals = []
                for rr in draws:
                    subset = [j for j in range(i + 1) if rr[0, hi, i, j] < n]
                    dd = brute_distances(pat[0, hi, i], v[0, :, hi], subset, list(range(i + 1)))
                    vals.append(brute_f(dd, set(subset)))
                assert out["f_random"][0, hi, i, t].item() == pytest.approx(sum(vals) / n_random, abs=1e-6)


def test_query_stride_keeps_last_query_and_matches_full_run() -> None:
    pat = causal_pattern(1, 2, 9, seed=7)
    v = torch.randn(1, 9, 2, 3, generator=torch.Generator().manual_seed(8), dtype=F64)
    full = layer_selection(pat, v, ns=[1, 2], n_random=0, dtype=F64)
    part = layer_selection(pat, v, ns=[1, 2], n_random=0, dtype=F64, query_stride=3)
    assert part["queries"] == [2, 5, 8]
    for name in ("f_top", "f_nosink", "certificate", "bound"):
        assert torch.allclose(
            part["per_query"][name], full["per_query"][name][:, :, [2, 5, 8]], equal_nan=True
        )


# --------------------------------------------------------------------------- projected space and the model path


def test_projected_distances_match_materialised_tiny_model() -> None:
    model = make_tiny(n_kv=2, b_O=False)
    tokens = random_tokens(2, 9)
    _, cache = model.run_with_cache(tokens)
    layer = 1
    pat = cache[f"blocks.{layer}.attn.hook_pattern"].double()
    v = expand_kv(cache[f"blocks.{layer}.attn.hook_v"], model.cfg.n_heads).double()
    W_O = model.blocks[layer].attn.W_O.detach().double()
    res = token_selection_from_cache(
        model, cache, layers=[layer], ns=[2, 3], n_random=0, projected=True, dtype=F64
    )
    hooked = token_selection(model, tokens, layers=[layer], ns=[2, 3], n_random=0, projected=True, dtype=F64)
    assert torch.allclose(res.per_query["f_top"], hooked.per_query["f_top"], equal_nan=True)
    vt = torch.einsum("bkhd,hdm->bkhm", v, W_O)  # [b k h d_model]
    for bi in range(2):
        for hi in range(model.cfg.n_heads):
            for i in range(2, 9):
                for t, n in enumerate([2, 3]):
                    top = brute_top(pat[bi, hi, i].tolist(), list(range(i + 1)), n)
                    y = pat[bi, hi, i, : i + 1, None] * vt[bi, : i + 1, hi]  # materialised [k, d_model]
                    s = y[top].sum(0)
                    dd = {j: float((y[j] - s).norm()) for j in range(i + 1)}
                    got = res.per_query["f_top"][bi, 0, hi, i, t].item()
                    assert got == pytest.approx(brute_f(dd, set(top)), abs=1e-6)
    # value space differs from projected space in general (W_O is not an isometry)
    val = token_selection(model, tokens, layers=[layer], ns=[2, 3], n_random=0, dtype=F64)
    assert not torch.allclose(val.per_query["m_inv"], res.per_query["m_inv"], equal_nan=True)


def test_model_path_to_frame_and_params() -> None:
    model = make_tiny(n_layers=2)
    tokens = random_tokens(2, 10)
    res = token_selection(model, tokens, ns=[1, 2, 4], n_random=2)
    frame = res.to_frame()
    assert len(frame) == 2 * 4 * 3
    assert {"layer", "head", "N", "f_top", "f_random", "f_gap", "f_nosink", "certificate", "bound"} <= set(
        frame
    )
    assert (frame.cert_violations == 0).all() and (frame.bound_violations == 0).all()
    assert (frame.loc[frame.N == 1, "f_top"] == 1).all()
    sel = frame[(frame.layer == 1) & (frame["head"] == 2) & (frame.N == 2)].iloc[0]
    f = res.per_query["f_top"][:, 1, 2, :, 1]
    assert sel.f_top == pytest.approx(f[~torch.isnan(f)].double().mean().item(), abs=1e-6)
    params = res.params_frame()
    assert len(params) == 8 and {"nu", "rho", "kappa", "mu", "regime"} <= set(params)
    assert not has_hooks(model)


def test_bad_input_errors() -> None:
    pat = causal_pattern(1, 2, 5, seed=0)
    v = torch.randn(1, 5, 2, 3, dtype=F64)
    with pytest.raises(ValueError, match="positive"):
        layer_selection(pat, v, ns=[0])
    with pytest.raises(ValueError, match="empty"):
        layer_selection(pat, v, ns=[])
    with pytest.raises(ValueError, match="q == k"):
        layer_selection(pat[:, :, :3], v)
    with pytest.raises(ValueError, match="does not match"):
        layer_selection(pat, v[:, :4])
    with pytest.raises(IndexError, match="sink"):
        layer_selection(pat, v, sink_positions=[5])
    with pytest.raises(ValueError, match="W_O"):
        layer_selection(pat, v, projected=True)
    with pytest.raises(ValueError, match="n_random"):
        layer_selection(pat, v, n_random=-1)
    with pytest.raises(ValueError, match="query_stride"):
        layer_selection(pat, v, query_stride=0)
    model = make_tiny(n_layers=2)
    with pytest.raises(IndexError):
        token_selection(model, random_tokens(1, 5), layers=[2])

    def boom(t: torch.Tensor, hook: object) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        token_selection(model, random_tokens(1, 5), extra_hooks=[("blocks.1.attn.hook_pattern", boom)])
    assert not has_hooks(model)


# --------------------------------------------------------------------------- the sink-aware bound


def regime_values(
    b: int,
    k: int,
    h: int,
    d: int,
    nu: float,
    rho: float,
    kappa: float,
    seed: int,
    n_sinks: int = 1,
    spread: float = 1.0,
) -> torch.Tensor:
    """Values satisfying the regime exactly: non-sink norms in [nu, spread*nu], sink norms in
    [rho*nu, spread*rho*nu], cos(sink, j) = -kappa (spread = 1: the constant-norm regime)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(b, k, h, d - 1, generator=g, dtype=F64)
    w = w / w.norm(dim=-1, keepdim=True)
    v = torch.empty(b, k, h, d, dtype=F64)
    v[..., 0] = -kappa * nu
    v[..., 1:] = math.sqrt(1 - kappa**2) * nu * w
    v[:, :n_sinks] = 0
    v[:, :n_sinks, :, 0] = rho * nu
    return v * (1 + (spread - 1) * torch.rand(b, k, h, 1, generator=g, dtype=F64))


def true_params(
    v: torch.Tensor, nu: float, rho: float, kappa: float, n_sinks: int = 1, spread: float = 1.0
) -> BoundParams:
    """The regime's parameters (the construction's norm bands), with mu the largest non-sink cosine
    found by explicit loops."""
    h = v.shape[2]
    mu = []
    for hi in range(h):
        best = -1.0
        for bi in range(v.shape[0]):
            for j in range(n_sinks, v.shape[1]):
                for k2 in range(j + 1, v.shape[1]):
                    best = max(
                        best, float(torch.nn.functional.cosine_similarity(v[bi, j, hi], v[bi, k2, hi], dim=0))
                    )
        mu.append(best)
    full = torch.full((h,), 1.0, dtype=F64)
    return BoundParams(
        nu=full * nu,
        nu_min=full * nu,
        nu_max=full * nu * spread,
        sink_min=full * rho * nu,
        sink_max=full * rho * nu * spread,
        mu=torch.tensor(mu, dtype=F64),
        kappa=full * kappa,
        rho=full * rho,
    )


@settings(max_examples=100, deadline=None)
@given(
    k=st.integers(3, 10),
    d=st.integers(3, 7),
    nu=st.floats(0.3, 5.0),
    rho=st.floats(0.05, 0.95),
    kappa=st.floats(0.0, 0.95),
    boost=st.floats(-1.0, 5.0),
    scale=st.floats(0.2, 5.0),
    n_sinks=st.integers(1, 2),
    spread=st.sampled_from([1.0, 1.0, 1.3, 2.5]),
    seed=st.integers(0, 10_000),
)
def test_bound_holds_on_synthetic_regime(
    k: int,
    d: int,
    nu: float,
    rho: float,
    kappa: float,
    boost: float,
    scale: float,
    n_sinks: int,
    spread: float,
    seed: int,
) -> None:
    b, h = 1, 2
    v = regime_values(b, k, h, d, nu, rho, kappa, seed, n_sinks, spread)
    pat = causal_pattern(b, h, k, seed + 1, scale=scale, sink_boost=boost)
    params = true_params(v, nu, rho, kappa, n_sinks, spread)
    sinks = list(range(n_sinks))
    cand = candidate_mask(k)
    sink_mask = torch.zeros(k, dtype=torch.bool)
    sink_mask[sinks] = True
    for n in (1, 2, 3, 5):
        mem = (source_ranks(pat, cand) < n) & cand
        bound, m_plus, q_minus = sink_aware_bound(pat, mem, cand, sink_mask, params)
        upper, lower = bound_radii(pat, mem, cand, sink_mask, params)
        for hi in range(h):
            for i in range(k):
                top = brute_top(pat[0, hi, i].tolist(), list(range(i + 1)), n)
                dd = brute_distances(pat[0, hi, i], v[0, :, hi], top, list(range(i + 1)))
                f = brute_f(dd, set(top))
                m, q = brute_mq(dd, set(top))
                for j, dj in dd.items():  # steps 3 and 5 of the proof, source by source
                    if j in top:
                        assert upper[0, hi, i, j].item() >= dj - 1e-9 and math.isnan(
                            lower[0, hi, i, j].item()
                        )
                    else:
                        assert lower[0, hi, i, j].item() <= dj + 1e-9 and math.isnan(
                            upper[0, hi, i, j].item()
                        )
                assert m <= m_plus[0, hi, i] and q >= q_minus[0, hi, i]
                assert bound[0, hi, i].item() <= f + 1e-12
    # the fitted parameters recover the construction
    if spread != 1.0:
        return
    fit = fit_bound_params(v, sinks)
    assert torch.allclose(fit.nu_min, params.nu_min) and torch.allclose(fit.nu_max, params.nu_max)
    assert torch.allclose(fit.sink_max, params.sink_max) and torch.allclose(fit.kappa, params.kappa)
    assert torch.allclose(fit.rho, params.rho)
    if k - n_sinks >= 2:  # mu needs a pair of non-sink values
        assert torch.allclose(fit.mu, params.mu)


def test_bound_is_tight_for_n1_and_informative() -> None:
    k = 12
    v = regime_values(2, k, 3, 6, nu=2.0, rho=0.3, kappa=0.5, seed=1)
    pat = causal_pattern(2, 3, k, seed=2, scale=3.0, sink_boost=2.0)
    params = true_params(v, 2.0, 0.3, 0.5)
    cand = candidate_mask(k)
    sink_mask = torch.arange(k) == 0
    mem = (source_ranks(pat, cand) < 1) & cand
    bound = sink_aware_bound(pat, mem, cand, sink_mask, params)[0]
    assert torch.equal(bound, torch.ones_like(bound))  # strict top everywhere (continuous weights)
    # with a larger N the bound is still a non-trivial fraction on this peaked profile
    mem2 = (source_ranks(pat, cand) < 2) & cand
    assert sink_aware_bound(pat, mem2, cand, sink_mask, params)[0][:, :, 1:].mean() > 0.5


def test_wrong_regime_parameters_can_break_the_bound() -> None:
    """The bound is only as good as its assumptions: claiming anti-alignment that is absent fails."""
    k = 10
    v = regime_values(1, k, 1, 4, nu=1.0, rho=0.9, kappa=0.0, seed=3)
    v[:, 0] = v[:, 5]  # the sink is a copy of a non-sink value: cos = 1, not -kappa
    pat = causal_pattern(1, 1, k, seed=4, scale=0.3)
    cand = candidate_mask(k)
    sink_mask = torch.arange(k) == 0
    honest = fit_bound_params(v, [0])
    lying = BoundParams(**{**honest.as_dict(), "kappa": torch.ones(1, dtype=F64)})
    mem = (source_ranks(pat, cand) < 3) & cand
    d = selection_distances(pat, v, mem)
    f = extreme_f_score(d, mem, cand)
    assert (sink_aware_bound(pat, mem, cand, sink_mask, honest)[0] <= f + 1e-12)[..., 2:].all()
    assert (sink_aware_bound(pat, mem, cand, sink_mask, lying)[0] > f + 1e-12).any()


# --------------------------------------------------------------------------- exact ties (issue 12)


def exact_f(a: list[float], vals: list[list[float]], members: list[int], cands: list[int]) -> float:
    """F_N in exact rational arithmetic on the given floats (Fraction(x) is exact): d_j² as fractions,
    then the loop over radii (the squares have the same order and ties as the distances)."""
    fa = [Fraction(x) for x in a]
    fv = [[Fraction(x) for x in row] for row in vals]
    s = [sum((fa[j] * fv[j][c] for j in members), Fraction(0)) for c in range(len(fv[0]))]
    d2 = {j: sum(((fa[j] * fv[j][c] - s[c]) ** 2 for c in range(len(s))), Fraction(0)) for j in cands}
    return brute_f(d2, set(members))  # type: ignore[arg-type]


def reference_beta(
    a: list[float],
    sinks: set[int],
    params: BoundParams,
    head: int,
    members: list[int],
    cands: list[int],
    slack: float = 0.0,
) -> float:
    """The theorem's beta, term by term as in docs/selection_bound.md, in 50-digit decimals, with the given
    (float) parameters; ``slack`` moves every comparison by ``slack * R²`` (``R = A + max_k a_k n⁺_k``)
    against the bound, so the computed bound must be at least this value."""
    getcontext().prec = 50
    p = {k: Decimal(float(t[head])) for k, t in params.as_dict().items() if t.numel()}
    lo = {j: p["sink_min"] if j in sinks else p["nu_min"] for j in cands}
    hi = {j: p["sink_max"] if j in sinks else p["nu_max"] for j in cands}
    w = {j: Decimal(a[j]) for j in cands}

    def pp(j: int, k: int) -> Decimal:
        n_sinks = (j in sinks) + (k in sinks)
        c = [p["mu"], -p["kappa"], Decimal(1)][n_sinks]  # the cosine bound of the pair
        return c * hi[j] * hi[k] if c >= 0 else c * lo[j] * lo[k]

    def q_plus(t: list[int]) -> Decimal:
        return sum((w[j] * w[k] * (hi[j] ** 2 if j == k else pp(j, k)) for j in t for k in t), Decimal(0))

    def sqrt0(x: Decimal) -> Decimal:
        return max(x, Decimal(0)).sqrt()

    u = {j: sqrt0(q_plus([m for m in members if m != j])) for j in members}
    s_minus = max(Decimal(0), max(w[j] * lo[j] - u[j] for j in members))
    s_plus = sqrt0(q_plus(members))
    outs = [k for k in cands if k not in members]
    low2 = {}
    for k in outs:
        x = sum((w[m] * pp(k, m) for m in members), Decimal(0))
        e1 = w[k] ** 2 * lo[k] ** 2 - 2 * w[k] * x + s_minus**2
        e2 = max(Decimal(0), s_minus - w[k] * hi[k]) ** 2
        e3 = max(Decimal(0), w[k] * lo[k] - s_plus) ** 2
        low2[k] = max(e1, e2, e3, Decimal(0))
    big_r = sum((w[m] * hi[m] for m in members), Decimal(0)) + max(w[j] * hi[j] for j in cands)
    sl = Decimal(slack) * big_r**2
    u_star2 = max(u.values()) ** 2
    min_l2 = min(low2.values()) if outs else None
    m_plus = sum(1 for k in outs if low2[k] <= u_star2 + sl)
    q_minus = sum(1 for j in members if min_l2 is None or u[j] ** 2 + sl < min_l2)
    n = len(members)
    return max(2 * n / (2 * n + m_plus), 2 * q_minus / (n + q_minus))


def tie_reproducer() -> tuple[torch.Tensor, torch.Tensor]:
    """Issue 12: u = (.6, .8, 0); V = (−u/2, u, u, u, u, u, u); the identity pattern except its last row."""
    u = [0.6, 0.8, 0.0]
    vals = [[-0.5 * x for x in u]] + [u] * 6
    pat = torch.eye(7, dtype=F64)
    pat[6] = torch.tensor([0.59, 0.0, 0.0, 0.07, 0.21, 0.0, 0.13], dtype=F64)
    return pat[None, None], torch.tensor(vals, dtype=F64)[None, :, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tie_reproducer_bound_never_exceeds_f(dtype: torch.dtype) -> None:
    pat, v = tie_reproducer()
    out = layer_selection(pat, v, ns=[5], n_random=0, dtype=dtype)["per_query"]
    a, vals = pat[0, 0, 6].tolist(), v[0, :, 0].tolist()
    top = brute_top(a, list(range(7)), 5)
    # member 1 and non-members 2, 5 have weight 0: d = ‖s‖ = 0.115 for all three
    assert top == [0, 4, 6, 3, 1]
    f = exact_f(a, vals, top, list(range(7)))
    assert f == pytest.approx(5 / 6, abs=1e-12)
    got = {k: out[k][0, 0, 6, 0].item() for k in ("f_top", "certificate", "bound", "bound_ideal")}
    assert got["f_top"] == pytest.approx(f, abs=1e-6)
    for name in ("certificate", "bound", "bound_ideal"):  # norms are constant: bound_ideal is guaranteed here
        assert got[name] <= f + 1e-6, (name, got)
    # still informative: in exact arithmetic m = m+ = 2 and q = q- = 3, so beta = max(10/12, 6/8) = F
    assert got["bound"] == pytest.approx(5 / 6, abs=1e-6)
    assert out["m_inv"][0, 0, 6, 0].item() == 2 and out["q_inv"][0, 0, 6, 0].item() == 3
    # the same through sink_aware_bound with the regime's exact parameters (nu = 1, rho = 1/2, kappa = mu = 1)
    one = torch.ones(1, dtype=F64)
    params = BoundParams(one, one, one, one / 2, one / 2, one, one, one / 2)
    cand = candidate_mask(7)
    mem = (source_ranks(pat, cand) < 5) & cand
    bound, m_plus, q_minus = sink_aware_bound(pat, mem, cand, torch.arange(7) == 0, params, dtype=dtype)
    assert (m_plus[0, 0, 6].item(), q_minus[0, 0, 6].item()) == (2, 3)
    assert bound[0, 0, 6].item() <= f + 1e-6
    ref = reference_beta(a, {0}, params, 0, top, list(range(7)))  # the theorem term by term
    assert bound[0, 0, 6].item() == pytest.approx(ref, abs=1e-6) and ref == pytest.approx(5 / 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_duplicated_values_of_equal_weight_at_n1(dtype: torch.dtype) -> None:
    """Two copies of one value with the same (largest) weight, constant non-sink norm: F_1 = 2/3, and the
    duplicate's L_k² = a²ν² − 2a(aν²) + (aν)² is 0 exactly but rounds to a tiny positive number."""
    nu = 1.7
    dirs = [[0.0, 0.6, 0.8], [0.8, 0.0, 0.6], [0.6, 0.8, 0.0], [0.6, 0.8, 0.0]]
    vals = [[-0.5 * nu * x for x in dirs[0]]] + [[nu * x for x in r] for r in dirs[1:]]
    v = torch.tensor(vals, dtype=F64)[None, :, None, :]
    pat = torch.eye(4, dtype=F64)
    pat[3] = torch.tensor([0.24, 0.16, 0.3, 0.3], dtype=F64)
    out = layer_selection(pat[None, None], v, ns=[1], n_random=0, dtype=dtype)["per_query"]
    a = pat[3].tolist()
    f = exact_f(a, vals, [2], [0, 1, 2, 3])
    assert f == pytest.approx(2 / 3, abs=1e-12)  # d_2 = d_3 = 0: the ball at radius 0 holds both
    assert out["f_top"][0, 0, 3, 0].item() == pytest.approx(f, abs=1e-6)
    for name in ("certificate", "bound", "bound_ideal"):
        assert out[name][0, 0, 3, 0].item() <= f + 1e-6, name
    assert out["bound"][0, 0, 3, 0].item() == pytest.approx(2 / 3, abs=1e-6)  # m+ = 1: exactly F
    # a strict top (the copy's weight a little lower) is decided as in exact arithmetic: beta = 1 = F
    pat[3, 3] = 0.29
    strict = layer_selection(pat[None, None], v, ns=[1], n_random=0, dtype=dtype)["per_query"]
    assert strict["bound"][0, 0, 3, 0].item() == 1.0 and strict["f_top"][0, 0, 3, 0].item() == 1.0


def test_tie_margin_rtol_is_checked_and_zero_margin_is_the_plain_comparison() -> None:
    d = torch.tensor([[0.0, 1.0, 1.0 + 1e-15, 3.0]], dtype=F64)
    mem = torch.tensor([[True, True, False, False]])
    valid = torch.ones_like(mem)
    assert inversion_certificate(d, mem, valid)[1].item() == 1  # the near-tie counts in m
    assert inversion_certificate(d, mem, valid, rtol=0.0)[1].item() == 0  # exact comparison: it does not
    with pytest.raises(ValueError, match="rtol"):
        inversion_certificate(d, mem, valid, rtol=-1e-3)
    pat, v = tie_reproducer()
    with pytest.raises(ValueError, match=r"float32.*float64"):
        layer_selection(pat, v, ns=[5], dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        token_selection(make_tiny(n_layers=1), random_tokens(1, 5), dtype=torch.int64)


#: unit directions with exact rational coordinates (Pythagorean triples) and their negatives
DIRECTIONS = [
    (1.0, 0.0, 0.0),
    (0.0, 1.0, 0.0),
    (0.6, 0.8, 0.0),
    (0.0, 0.6, 0.8),
    (0.8, 0.0, 0.6),
    (-0.6, 0.8, 0.0),
]
WEIGHTS = [0.0, 0.07, 0.1, 0.13, 0.21, 0.25, 0.3, 0.5, 0.59]


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(3, 8),
    nu=st.sampled_from([1.0, 1.7, 0.3]),
    sink=st.tuples(st.integers(0, len(DIRECTIONS) - 1), st.sampled_from([0.25, 0.5, 0.9])),
    rows=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([1.0, 1.0, 1.0, 2.0, 0.5])), min_size=7, max_size=7
    ),
    weights=st.lists(st.sampled_from(WEIGHTS), min_size=64, max_size=64),
    normalise=st.booleans(),
    compensate=st.booleans(),
)
def test_bound_and_certificate_never_exceed_exact_f_near_ties(
    k: int,
    nu: float,
    sink: tuple[int, float],
    rows: list[tuple[int, float]],
    weights: list[float],
    normalise: bool,
    compensate: bool,
) -> None:
    """Near-tied inputs: values drawn from 4 directions (so duplicated rows are frequent), scaled copies
    (x2, x1/2, optionally with the weight scaled back so that y_j = y_k exactly), weights from a short list
    (equal weights, zeros). Every input is a float32 number, so both dtypes solve the same problem; F_N is
    computed exactly (fractions)."""
    sdir, rho = sink
    vals = [[-rho * nu * x for x in DIRECTIONS[sdir]]] + [
        [mult * nu * x for x in DIRECTIONS[di]] for di, mult in rows[: k - 1]
    ]
    a = torch.tensor(weights[: k * k], dtype=F64).reshape(k, k).tril()
    if normalise:
        a = a / a.sum(-1, keepdim=True).clamp_min(1e-9)
    a = a.float().double()
    if compensate:  # a scaled copy gets the weight scaled back: its contribution equals the original's
        for j in range(1, k):
            for m in range(1, j):
                if rows[j - 1][0] == rows[m - 1][0]:
                    a[j:, j] = a[j:, m] * (rows[m - 1][1] / rows[j - 1][1])
                    break
    v32 = torch.tensor(vals, dtype=torch.float32).double()
    vals = v32.tolist()
    pat, v = a[None, None], v32[None, :, None, :]
    ns = [1, 2, 3, 5]
    params = fit_bound_params(v, [0])  # what layer_selection fits (float64, value space)
    for dtype, slack in ((torch.float32, 2e-2), (torch.float64, 1e-6)):
        out = layer_selection(pat, v, ns=ns, n_random=0, dtype=dtype)["per_query"]
        for i in range(k):
            row = a[i].tolist()
            for t, n in enumerate(ns):
                if i + 1 < n:
                    continue
                cands = list(range(i + 1))
                top = brute_top(row, cands, n)
                f = exact_f(row, vals, top, cands)
                bound, cert = out["bound"][0, 0, i, t].item(), out["certificate"][0, 0, i, t].item()
                assert bound <= f + 1e-6, (dtype, i, n, bound, f)
                assert cert <= f + 1e-6, (dtype, i, n, cert, f)
                assert cert <= out["f_top"][0, 0, i, t].item() + 1e-6
                # informative: the bound loses only comparisons within slack * R² of a tie
                ref = reference_beta(row, {0}, params, 0, top, cands, slack=slack)
                assert bound >= ref - 1e-6, (dtype, i, n, bound, ref)


# --------------------------------------------------------------------------- layout, collector, summaries, figures


def test_split_modules_reexport_and_collector_signature() -> None:
    """The package exports every public name of its modules, as the same objects; ``result(tokens=None)``."""
    import mechgeom
    from mechgeom.analyses import selection
    from mechgeom.analyses.selection import bounds as selection_bounds, geometry as selection_geometry

    for mod in (selection_geometry, selection_bounds):
        for name in mod.__all__:
            assert getattr(selection, name) is getattr(mod, name), name
            assert name in selection.__all__, name
    assert mechgeom.SelectionCollector is selection.SelectionCollector
    model = make_tiny(n_layers=2)
    tokens = random_tokens(2, 8)
    col = selection.SelectionCollector(model, [1], ns=[1, 2], n_random=1)
    _, cache = model.run_with_cache(tokens)
    col.feed_cache(cache)
    without, with_tokens = col.result(), col.result(tokens=tokens)
    assert without.tokens is None and with_tokens.tokens is not None
    assert torch.equal(with_tokens.tokens, tokens)
    assert torch.equal(
        without.per_query["f_top"].nan_to_num(-1), with_tokens.per_query["f_top"].nan_to_num(-1)
    )


def _nanmean(values: list[float]) -> float:
    kept = [float(v) for v in values if not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else math.nan


def _plain(obj: object) -> bool:
    """Only the types ``json`` writes as they are: dicts with str keys, lists, str, int, float, bool, None."""
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_plain(v) for v in obj)
    return obj is None or type(obj) in (str, int, float, bool)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_summary_matches_bruteforce_from_frames_and_tensors() -> None:
    import json
    import statistics

    model = make_tiny(n_layers=2)
    tokens = random_tokens(3, 10)
    ns = [1, 2, 4, 8]
    res = token_selection(model, tokens, ns=ns, n_random=2, seed=3)
    s = res.summary(small_n=2)
    json.dumps(s)
    assert _plain(s)
    rows = res.to_frame().to_dict(orient="records")
    prows = res.params_frame().to_dict(orient="records")
    assert (s["n_layers"], s["n_heads"], s["ns"], s["n_texts"]) == (2, 4, ns, 3)
    assert (s["queries_per_text"], s["n_queries"], s["windows"]) == (10, 30, [3, 10])
    assert (s["n_random"], s["projected"], s["sink_positions"], s["small_n"]) == (2, False, [0], 2)
    for k in ("f_top", "f_random", "f_gap"):
        assert _same(s[k], _nanmean([r[k] for r in rows if r["N"] <= 2])), k
    both = [r for r in rows if not math.isnan(r["f_top_sink_in"]) and not math.isnan(r["f_nosink_sink_in"])]
    assert both
    for k in ("f_top_sink_in", "f_nosink_sink_in"):
        assert _same(s[k], sum(r[k] for r in both) / len(both)), k
    assert s["cert_violations"] == sum(r["cert_violations"] for r in rows) == 0
    assert s["bound_violations"] == sum(r["bound_violations"] for r in rows) == 0
    assert s["regime_share"] == pytest.approx(sum(bool(p["regime"]) for p in prows) / len(prows))
    # largest gaps: per-N mean of f_gap over heads (first maximum), and the row with the largest f_gap
    gaps = {n: _nanmean([r["f_gap"] for r in rows if r["N"] == n]) for n in ns}
    best = max(ns, key=lambda n: (gaps[n], -ns.index(n)))
    lg = s["largest_mean_gap"]
    assert lg["N"] == best and _same(lg["gap"], gaps[best])
    assert _same(lg["f_top"], _nanmean([r["f_top"] for r in rows if r["N"] == best]))
    assert _same(lg["f_random"], _nanmean([r["f_random"] for r in rows if r["N"] == best]))
    top = max(range(len(rows)), key=lambda i: (rows[i]["f_gap"], -i))
    assert s["largest_head_gap"] == pytest.approx(
        {k: rows[top][k] for k in ("layer", "head", "N", "f_top", "f_random", "f_gap")}
    )
    viol = s["violations"]
    assert viol["bound_ideal"] == sum(r["ideal_violations"] for r in rows)
    assert viol["bound_ideal_share_of_queries"] == pytest.approx(
        viol["bound_ideal"] / sum(r["n_queries"] for r in rows)
    )
    for k in ("sink_small", "sink_opposed", "near_constant", "regime"):
        assert s["regime_flags_share_of_heads"][k] == pytest.approx(
            sum(bool(p[k]) for p in prows) / len(prows)
        )
    for k in ("nu", "rho", "kappa", "kappa_mean", "mu", "mu_mean"):
        assert s["bound_params_median"][k] == pytest.approx(statistics.median(p[k] for p in prows), rel=1e-6)
    # sink effect: loops over every (text, layer, head, query) entry of the tensors
    pq = res.per_query
    for t, rec in enumerate(s["sink_effect"]):
        pairs, n_def = [], 0
        for idx in torch.cartesian_prod(*(torch.arange(d) for d in pq["f_top"].shape[:4])).tolist():
            f, f_ns = pq["f_top"][(*idx, t)].item(), pq["f_nosink"][(*idx, t)].item()
            n_def += not math.isnan(f)
            if pq["sink_in_top"][(*idx, t)].item() > 0.5 and not math.isnan(f) and not math.isnan(f_ns):
                pairs.append((f, f_ns))
        assert rec["N"] == ns[t] and rec["n_pairs"] == len(pairs)
        assert _same(rec["share_sink_in_top"], len(pairs) / n_def)
        if pairs:
            with_s, without = sum(a for a, _ in pairs) / len(pairs), sum(b for _, b in pairs) / len(pairs)
            assert _same(rec["f_with_sink"], with_s) and _same(rec["f_without_sink"], without)
            assert _same(rec["ratio_of_means"], with_s / without)
            assert _same(rec["share_halved"], sum(a <= 0.5 * b for a, b in pairs) / len(pairs))
            assert _same(rec["share_lower"], sum(a < b for a, b in pairs) / len(pairs))
    # bound vs measured: query-weighted means per scope and N
    regime = {(p["layer"], p["head"]) for p in prows if p["regime"]}
    got = {(r["scope"], r["N"]): r for r in s["bound_by_n"]}
    for scope, keep in (
        ("all heads", lambda r: True),
        ("regime heads", lambda r: (r["layer"], r["head"]) in regime),
    ):
        for n in ns:
            part = [r for r in rows if r["N"] == n and keep(r)]
            if not part:
                assert (scope, n) not in got
                continue
            rec, w = got[(scope, n)], sum(r["n_queries"] for r in part)
            assert (rec["n_heads"], rec["n_queries"]) == (len(part), w)
            assert rec["bound_violations"] == sum(r["bound_violations"] for r in part)
            assert rec["ideal_violations"] == sum(r["ideal_violations"] for r in part)
            for col, src in (("measured", "f_top"), ("bound", "bound"), ("bound_ideal", "bound_ideal")):
                want = sum(r[src] * r["n_queries"] for r in part) / w if w else math.nan
                assert _same(rec[col], want), (scope, n, col)
    # the tables behind the summary are the result's frames
    by_n = res.by_n_frame().set_index("N")
    for n in ns:
        for k in ("f_top", "f_random", "f_gap", "certificate", "bound"):
            assert _same(by_n.loc[n, k], _nanmean([r[k] for r in rows if r["N"] == n])), (n, k)
        assert by_n.loc[n, "ideal_violations"] == sum(r["ideal_violations"] for r in rows if r["N"] == n)
    assert res.sink_effect_frame().to_dict(orient="records") == s["sink_effect"]
    assert res.bound_frame().to_dict(orient="records") == s["bound_by_n"]


def test_summary_without_baseline_or_bound() -> None:
    model = make_tiny(n_layers=1)
    res = token_selection(model, random_tokens(1, 6), ns=[1, 2], n_random=0, bound=False)
    s = res.summary()
    assert math.isnan(s["f_random"]) and math.isnan(s["f_gap"]) and math.isnan(s["regime_share"])
    assert s["largest_mean_gap"] is None and s["largest_head_gap"] is None
    assert s["regime_flags_share_of_heads"] == {} and s["bound_params_median"] == {} and s["bound_by_n"] == []
    assert s["bound_violations"] == 0 and s["f_top"] == pytest.approx(
        _nanmean(res.to_frame()["f_top"].tolist())
    )


def _selection_frames() -> tuple:  # type: ignore[type-arg]
    res = token_selection(make_tiny(n_layers=2), random_tokens(2, 10), ns=[1, 2, 4], n_random=1)
    return res.to_frame(), res.params_frame(), res.by_n_frame()


def test_selection_figures_draw_the_frames_numbers() -> None:
    import numpy as np
    from matplotlib.figure import Figure

    from mechgeom.viz.selection_figures import __all__ as fig_all, plot_selection_scores, plot_selection_vs_n

    assert set(fig_all) == {"plot_selection_scores", "plot_selection_vs_n"}
    df, params, by_n = _selection_frames()
    fig = plot_selection_scores(df, params)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    ax1, ax2 = fig.axes
    lines = {ln.get_label(): ln for ln in ax1.get_lines()}
    assert list(lines) == ["top-N", "random N-subsets", "top-N, sink excluded", "sink-aware bound (fitted)"]
    for label, col in (
        ("top-N", "f_top"),
        ("random N-subsets", "f_random"),
        ("sink-aware bound (fitted)", "bound"),
    ):
        for n, y in zip(lines[label].get_xdata(), lines[label].get_ydata(), strict=True):
            assert y == pytest.approx(_nanmean(df.loc[n == df.N, col].tolist()), rel=1e-6)
    pts = ax2.collections[0].get_offsets()
    np.testing.assert_allclose(np.asarray(pts), df[["bound_ideal", "f_top"]].to_numpy(), rtol=1e-6)
    fig2 = plot_selection_vs_n(by_n, df, "tiny")
    assert isinstance(fig2, Figure) and fig2.axes[0].get_title() == "tiny"
    lines2 = {ln.get_label(): ln for ln in fig2.axes[0].get_lines()}
    assert len(lines2) == 5
    for label, col in (
        ("constant-norm prediction", "bound_ideal"),
        ("sink-aware bound (guaranteed)", "bound"),
    ):
        np.testing.assert_allclose(lines2[label].get_ydata(), by_n[col].to_numpy(), rtol=1e-6)
        np.testing.assert_array_equal(lines2[label].get_xdata(), by_n["N"].to_numpy())
    with pytest.raises(ValueError, match="lacks"):
        plot_selection_scores(df.drop(columns="bound"))
