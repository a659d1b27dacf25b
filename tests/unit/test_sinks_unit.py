"""Unit tests of mechgeom.analyses.sinks.statistics on tiny seeded models, against loop-based references."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens
from hypothesis import example, given, settings, strategies as st
from refs import check_sink_statistics, close, cosine, sink_reference

from mechgeom.analyses.contribution.weights import LayerGeometry
from mechgeom.analyses.scoring import text_nll
from mechgeom.analyses.sinks import (
    ConvexityCurves,
    convex_minimiser,
    convex_norm,
    convexity_by_intervention,
    convexity_check,
    describe_values,
    random_control_positions,
    sink_ablation,
)
from mechgeom.analyses.sinks.statistics import (
    SinkCollector,
    SinkResult,
    sink_statistics,
    sink_statistics_from_cache,
    spread_sink_heads,
    top_sink_heads,
)
from mechgeom.hooks import (
    LayerCollector,
    affected_heads,
    has_hooks,
    hook_name,
    kv_groups,
    resolve_sinks,
    run_hooks,
    sink_mass_hooks,
    sink_value_hooks,
)
from mechgeom.viz import plot_cone_shift, plot_convexity_curves, plot_rate_vs_ratio, plot_sink_rate_vs_s_star

# --------------------------------------------------------------------------- loop reference


@pytest.mark.parametrize(("sinks", "n_kv"), [([0], None), ([0], 2), ([1, 3], 2)])
def test_statistics_match_loop_reference(sinks, n_kv):
    model = make_tiny(n_kv=n_kv)
    tokens = random_tokens(2, 9)
    res = sink_statistics(model, tokens, sink_positions=sinks, batch_size=1)
    ref = sink_reference(model, tokens, sinks)
    check_sink_statistics(res, ref, n_layers=2, n_heads=4, n_texts=2, pos=9, sinks=sinks)


def test_to_frame_one_row_per_head_and_sink():
    model = make_tiny(n_kv=2)
    res = sink_statistics(model, random_tokens(2, 8), sink_positions=[0, 2])
    df = res.to_frame()
    assert len(df) == 2 * 4 * 2
    assert set(df["sink"]) == {0, 2}
    assert df.groupby(["layer", "head"])["sink_rate"].nunique().max() == 1  # the set total is per head
    assert list(df["kv_head"][:8:2]) == [0, 0, 1, 1]
    expect = torch.nanmean(res.norm_ratio_vt, dim=0)
    np.testing.assert_allclose(df["norm_ratio_vt"].to_numpy(), expect.flatten().numpy(), rtol=1e-6)
    q = res.query_frame(layers=[1], heads=[0])
    assert len(q) == 2 * (8 - 3) and q["query"].min() == 3


# --------------------------------------------------------------------------- convexity


@pytest.mark.parametrize(("sinks", "n_kv"), [([0], None), ([0, 2], 2)])
def test_closed_form_matches_intervention(sinks, n_kv):
    model = make_tiny(n_kv=n_kv)
    tokens = random_tokens(2, 10)
    res = sink_statistics(model, tokens, sink_positions=sinks)
    grid = [0.0, 0.1, 0.37, 0.5, 0.9, 1.0]
    closed = res.norm_curve(grid)  # [n layer head q grid]
    for layer in range(2):
        meas = convexity_by_intervention(model, tokens, grid, layer=layer, heads=[1, 2], sink_positions=sinks)
        for k in range(len(grid)):
            want = closed[:, layer, :, :, k]  # [n head q]
            finite = torch.isfinite(want)
            assert finite[:, :, max(sinks) + 1 :].all()
            diff = (meas[k][:, [1, 2]] - want[:, [1, 2]]).abs()
            assert float(diff[finite[:, [1, 2]]].max()) < 1e-4
            # heads outside `heads` keep their clean output norm
            clean = res.head_out_norm()[:, layer][:, [0, 3]]
            d0 = (meas[k][:, [0, 3]] - clean).abs()
            assert float(d0[torch.isfinite(clean)].max()) < 1e-5


def test_intervention_moves_the_curve():
    """The check above is not vacuous: different s give different measured norms."""
    model = make_tiny()
    tokens = random_tokens(1, 10)
    meas = convexity_by_intervention(model, tokens, [0.0, 1.0], layer=0)
    assert float((meas[0] - meas[1]).abs().nan_to_num(0).max()) > 1e-2


def test_sink_mass_hook_sets_the_mass():
    model = make_tiny()
    tokens = random_tokens(2, 8)
    hooks = sink_mass_hooks(model, 0.3, layers=[1], heads=[0, 2], sink_positions=[0, 1])
    _, clean = model.run_with_cache(tokens)
    with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        _, cache = model.run_with_cache(tokens)
    pat, ref = cache["blocks.1.attn.hook_pattern"], clean["blocks.1.attn.hook_pattern"]
    torch.testing.assert_close(pat.sum(-1), torch.ones_like(pat.sum(-1)))
    torch.testing.assert_close(pat[:, [0, 2], 2:, :2].sum(-1), torch.full((2, 2, 6), 0.3))
    # proportions inside the sink set and inside the rest are kept
    torch.testing.assert_close(
        pat[:, 0, 2:, 2:] / pat[:, 0, 2:, 2:].sum(-1, keepdim=True),
        ref[:, 0, 2:, 2:] / ref[:, 0, 2:, 2:].sum(-1, keepdim=True),
    )
    torch.testing.assert_close(pat[:, [1, 3]], ref[:, [1, 3]])  # other heads untouched
    torch.testing.assert_close(pat[:, :, :2], ref[:, :, :2])  # queries outside Q untouched
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"], clean["blocks.0.attn.hook_pattern"])
    assert not has_hooks(model)


vec = st.lists(st.floats(-3, 3, allow_nan=False), min_size=4, max_size=4)


@settings(max_examples=60, deadline=None)
@given(vt0=vec, m=vec)
@example(vt0=[0.0, 0.0, 0.0, 0.0], m=[0.0, 0.0, 0.0, 4.6741933823661127e-48])  # tiny, not flat: s* = 1
@example(vt0=[1.0, 0.0, 0.0, 0.0], m=[1.0, 0.0, 0.0, 0.0])  # flat: NaN
@example(vt0=[0.0, 0.0, 0.0, -0.25], m=[0.0, 0.0, 0.0, 1.0])  # o(0.8) = 0 exactly
@example(vt0=[0.0, 0.0, 0.0, -1.0412235307441322e-53], m=[0.0, 0.0, 0.0, 1.0])  # s* rounds to 1
def test_s_star_minimises_the_quadratic(vt0, m):
    a_vec, m_vec = torch.tensor(vt0, dtype=torch.float64), torch.tensor(m, dtype=torch.float64)
    a, x, c = a_vec @ a_vec, a_vec @ m_vec, m_vec @ m_vec
    s_star = convex_minimiser(a, x, c)
    if float(a - 2 * x + c) == 0:  # documented: a flat curve has no minimiser
        assert torch.isnan(s_star)
        return
    grid = torch.linspace(-2, 3, 2001, dtype=torch.float64)
    brute = (grid[:, None] * a_vec + (1 - grid)[:, None] * m_vec).norm(dim=-1)
    closed = convex_norm(a, x, c, grid)
    # compare the quadratic ‖o(s)‖² (a square root turns 1e-18 round-off at a zero of o(s) into 1e-9)
    torch.testing.assert_close(closed**2, brute**2, atol=1e-12, rtol=1e-9)
    best = float(convex_norm(a, x, c, float(s_star)))
    assert best <= float(brute.min()) + 1e-9
    # the interior test is exact only away from round-off: a near-flat curve or s* within 1e-9 of 0 or 1
    if float((a_vec - m_vec).norm()) > 1e-6 and min(abs(float(s_star)), abs(1 - float(s_star))) > 1e-9:
        assert bool((s_star > 0) & (s_star < 1)) == bool(x < min(a, c))


def test_interior_share_counts_finite_s_star():
    res = sink_statistics(make_tiny(), random_tokens(2, 8))
    st_ = res.s_star()
    inside = ((st_ > 0) & (st_ < 1)).sum((0, 3)).double() / torch.isfinite(st_).sum((0, 3))
    torch.testing.assert_close(res.interior_share(), inside)
    assert float(res.norm_excess().nan_to_num(2).min()) >= 1 - 1e-9


# --------------------------------------------------------------------------- ablation


def test_ablation_unchanged_is_identity():
    model = make_tiny(n_kv=2)
    tokens = random_tokens(2, 10)
    clean = run_hooks(model, tokens, [], return_type="logits")
    for kwargs in (
        {"mode": "unchanged"},
        {"mode": "scale", "scale": 1.0},
        {"mode": "mean_norm", "scale": 1.0},
    ):
        logits = run_hooks(model, tokens, sink_value_hooks(model, **kwargs), return_type="logits")
        if kwargs["mode"] == "mean_norm":
            assert not torch.equal(logits, clean)  # rescaling to the mean norm does change the model
        else:
            assert torch.equal(logits, clean)
    zero = run_hooks(model, tokens, sink_value_hooks(model, mode="zero"), return_type="logits")
    assert not torch.equal(zero, clean)


def _values_after(model, tokens, hooks, layer):
    seen = {}

    def grab(v, hook):
        seen["v"] = v.clone()

    run_hooks(model, tokens, [*hooks, (hook_name(layer, "v"), grab)], stop_at_layer=layer + 1)
    return seen["v"]


def test_value_ablation_modes():
    model = make_tiny(n_kv=2)
    tokens = random_tokens(2, 10)
    clean = _values_after(model, tokens, [], 1)  # [b pos kv d]
    sinks = [0, 3]
    zero = _values_after(model, tokens, sink_value_hooks(model, layers=1, heads=[2], sink_positions=sinks), 1)
    assert torch.equal(zero[:, sinks, 1], torch.zeros_like(zero[:, sinks, 1]))
    keep = [j for j in range(10) if j not in sinks]
    assert torch.equal(zero[:, keep], clean[:, keep]) and torch.equal(zero[:, :, 0], clean[:, :, 0])
    mean = _values_after(
        model, tokens, sink_value_hooks(model, layers=1, mode="mean_norm", sink_positions=sinks), 1
    )
    for b in range(2):
        for kv in range(2):
            target = np.mean([float(clean[b, j, kv].norm()) for j in keep])
            for s in sinks:
                assert float(mean[b, s, kv].norm()) == pytest.approx(target, rel=1e-5)
                assert cosine(mean[b, s, kv], clean[b, s, kv]) == pytest.approx(1.0, abs=1e-5)
    half = _values_after(model, tokens, sink_value_hooks(model, layers=1, mode="scale", scale=0.5), 1)
    torch.testing.assert_close(half[:, 0], clean[:, 0] * 0.5)
    # per-text positions (the control): text 0 ablates position 4, text 1 position 7
    ctrl = _values_after(
        model, tokens, sink_value_hooks(model, layers=1, positions=torch.tensor([[4], [7]])), 1
    )
    assert torch.equal(ctrl[0, 4], torch.zeros_like(ctrl[0, 4])) and torch.equal(
        ctrl[1, 7], torch.zeros_like(ctrl[1, 7])
    )
    assert torch.equal(ctrl[0, 7], clean[0, 7]) and torch.equal(ctrl[1, 4], clean[1, 4])
    assert torch.equal(ctrl[:, 0], clean[:, 0])


def _z_after(model, tokens, hooks, layer):
    col = LayerCollector(model, layer)
    run_hooks(model, tokens, [*hooks, *col.fwd_hooks], stop_at_layer=layer + 1)
    return col.captured[layer].z


@pytest.mark.parametrize(
    ("n_kv", "heads", "expected"), [(2, [1], [0, 1]), (2, [0, 3], [0, 1, 2, 3]), (None, [1], [1])]
)
def test_gqa_ablation_affects_exactly_the_kv_group(n_kv, heads, expected):
    model = make_tiny(n_kv=n_kv)
    tokens = random_tokens(2, 10)
    assert affected_heads(model, heads) == expected
    assert sorted(h for g in kv_groups(model, heads).values() for h in g) == expected
    clean = _z_after(model, tokens, [], 1)
    ablated = _z_after(model, tokens, sink_value_hooks(model, layers=1, heads=heads), 1)
    for h in range(4):
        same = torch.equal(ablated[:, :, h], clean[:, :, h])
        assert same == (h not in expected), h


def test_control_positions_seeded_and_never_sinks():
    a = random_control_positions(50, 12, [0, 5], seed=3)
    b = random_control_positions(50, 12, [0, 5], seed=3)
    c = random_control_positions(50, 12, [0, 5], seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (50, 1)
    assert not torch.isin(a, torch.tensor([0, 5])).any() and int(a.max()) < 12


def test_sink_ablation_result():
    model = make_tiny(n_kv=2)
    tokens = random_tokens(3, 10)
    res = sink_ablation(model, tokens, layers=[1], heads=[0], batch_size=2, seed=1)
    assert res.affected_heads == [0, 1]
    nll = {
        c: text_nll(model, tokens, hooks, batch_size=3)
        for c, hooks in (
            ("clean", []),
            ("sink", sink_value_hooks(model, layers=[1], heads=[0])),
            (
                "control",
                sink_value_hooks(model, layers=[1], heads=[0], positions=res.control_positions[:, None]),
            ),
        )
    }
    for c in nll:
        torch.testing.assert_close(res.nll[c], nll[c])
    assert res.delta_ppl("sink") == pytest.approx(
        float(torch.exp(nll["sink"].mean()) - torch.exp(nll["clean"].mean())), rel=1e-5
    )
    df = res.to_frame()
    assert len(df) == 2 * 4
    assert df.loc[df["ablated"], ["layer", "head"]].values.tolist() == [[1, 0], [1, 1]]
    # layer 0 is upstream of the ablation: unchanged; heads 2, 3 of layer 1 are in the other KV group
    unaffected = df[(df["layer"] == 0) | df["head"].isin([2, 3])]
    assert (unaffected["d_out_norm_sink"].abs() < 1e-6).all()
    assert (df.loc[df["ablated"], "d_out_norm_sink"].abs() > 1e-4).all()
    # the norms and cone cosines against a direct computation on one head
    col = LayerCollector(model, 1)
    run_hooks(model, tokens, col.fwd_hooks)
    geo = LayerGeometry.from_activations(col.captured[1])
    mu = geo.projected_values[:, 1:, 0].mean(1)  # [b m]
    cos = torch.nn.functional.cosine_similarity(geo.head_out[:, 1:, 0], mu[:, None], dim=-1).mean(1)
    torch.testing.assert_close(res.cone_cos["clean"][:, 1, 0], cos)
    torch.testing.assert_close(res.out_norm["clean"][:, 1, 0], geo.head_out_norm[:, 0, 1:].mean(1))
    summary = res.summary(n_boot=50)
    assert summary["dnll_sink_lo"] <= summary["dnll_sink"] <= summary["dnll_sink_hi"]
    # reusing the clean pass gives the same result
    again = sink_ablation(model, tokens, layers=[1], heads=[0], batch_size=2, seed=1, clean=res)
    torch.testing.assert_close(again.nll["sink"], res.nll["sink"])
    with pytest.raises(ValueError, match="other tokens"):
        sink_ablation(model, tokens[:, :9], layers=[1], clean=res)
    same = sink_ablation(model, tokens, mode="unchanged", batch_size=3)
    assert same.delta_ppl("sink") == 0.0 and same.delta_ppl("control") == 0.0


# --------------------------------------------------------------------------- edge cases


def test_sequence_of_length_one_is_all_nan():
    model = make_tiny()
    res = sink_statistics(model, random_tokens(2, 1))
    for t in (
        res.sink_rate,
        res.norm_ratio_v,
        res.norm_ratio_vt,
        res.cos_sink_tokens,
        res.cos_sink_mean,
        res.sink_mass,
    ):
        assert torch.isnan(t).all()
    assert torch.isnan(res.interior_share()).all() and torch.isnan(res.factor_shares()[0]).all()
    df = res.to_frame()
    assert len(df) == 8 and df[["sink_rate", "norm_ratio_vt", "s_star_median"]].isna().all().all()
    assert res.query_frame().empty
    assert torch.isnan(convexity_by_intervention(model, random_tokens(1, 1), [0.5], layer=0)).all()


def test_sequence_of_length_two():
    model = make_tiny(n_kv=2)
    tokens = random_tokens(1, 2)
    res = sink_statistics(model, tokens)
    ref = sink_reference(model, tokens, [0])
    assert torch.isfinite(res.sink_rate).all() and torch.isfinite(res.norm_ratio_vt).all()
    for layer in range(2):
        for h in range(4):
            assert close(res.sink_rate[0, layer, h], ref["rate"][(0, layer, h)])
            assert close(res.norm_ratio_v[0, layer, h, 0], ref["ratio_v"][(0, layer, h, 0)])
    shares, _, counts = res.factor_shares()
    assert (counts == 1).all() and torch.isnan(shares).all()  # one entry per group: no variance
    both = sink_statistics(model, tokens, sink_positions=[0, 1])  # no non-sink token left
    assert torch.isnan(both.sink_rate).all() and torch.isnan(both.norm_ratio_v).all()


def test_out_of_range_and_bad_input():
    model = make_tiny()
    tokens = random_tokens(1, 6)
    with pytest.raises(IndexError, match="layer"):
        sink_statistics(model, tokens, layers=[2])
    with pytest.raises(IndexError, match="head"):
        sink_mass_hooks(model, 0.5, heads=[4])
    with pytest.raises(IndexError, match="layer"):
        sink_value_hooks(model, layers=[-1])
    with pytest.raises(IndexError, match="head"):
        sink_ablation(model, tokens, heads=[7])
    with pytest.raises(IndexError, match="layer"):
        convexity_by_intervention(model, tokens, [0.5], layer=5)
    with pytest.raises(ValueError, match="mode"):
        sink_value_hooks(model, mode="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sink_mass_hooks(model, 1.5)
    with pytest.raises(ValueError, match="beyond the sequence"):
        resolve_sinks([6], pos=6)
    with pytest.raises(ValueError, match="duplicate"):
        resolve_sinks([1, 1])
    with pytest.raises(ValueError, match="beyond the sequence"):
        sink_ablation(model, tokens, sink_positions=[9])


def test_no_hooks_left_after_an_exception():
    model = make_tiny()
    tokens = random_tokens(1, 5)
    with pytest.raises(ValueError, match="beyond the sequence"):
        sink_statistics(model, tokens, sink_positions=[7])  # raised inside the reader hook
    assert not has_hooks(model)
    with pytest.raises(ValueError, match="beyond the sequence"):
        run_hooks(model, tokens, sink_mass_hooks(model, 0.5, sink_positions=[7]))
    assert not has_hooks(model)
    with pytest.raises(ValueError, match="outside the sequence"):
        text_nll(model, tokens, sink_value_hooks(model, positions=[9]))
    assert not has_hooks(model)


# --------------------------------------------------------------------------- plots


def _png_size(fig) -> int:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.tell()


def test_plots_draw_the_results():
    model = make_tiny(n_kv=2)
    tokens = random_tokens(2, 10)
    res: SinkResult = sink_statistics(model, tokens)
    heads = [(li, h) for li in range(2) for h in range(4)]  # the rows drawn, layer-major
    rate = [float(res.sink_rate[:, li, h].nanmean()) for li, h in heads]
    fig = plot_rate_vs_ratio(res)
    assert fig.axes[0].collections[0].get_offsets().shape == (8, 2)
    ratio = [float(res.norm_ratio_vt[:, li, h, 0].nanmean()) for li, h in heads]
    np.testing.assert_allclose(fig.axes[0].collections[0].get_offsets(), np.c_[rate, ratio], rtol=1e-6)
    assert np.asarray(fig.axes[0].collections[0].get_array()).tolist() == [li for li, _ in heads]
    assert fig.axes[0].get_yscale() == "log"
    assert _png_size(fig) < 300_000
    fig = plot_rate_vs_ratio(res, space="v")
    ratio_v = [float(res.norm_ratio_v[:, li, h, 0].nanmean()) for li, h in heads]
    np.testing.assert_allclose(fig.axes[0].collections[0].get_offsets(), np.c_[rate, ratio_v], rtol=1e-6)
    _png_size(fig)

    meas = convexity_by_intervention(model, tokens, [0.0, 0.5, 1.0], layer=1, heads=0)
    measured = {(1, 0): ([0.0, 0.5, 1.0], meas[:, 0, 0])}
    fig = plot_convexity_curves(res, [(0, 1), (1, 0)], measured=measured, n_queries=3)
    assert len(fig.axes) == 2 and len(fig.axes[1].lines) == 3 * 4
    assert _png_size(fig) < 300_000
    # queries with a finite sink mass are 1..9; three evenly spaced ones are drawn: 1, 5, 9
    assert torch.isfinite(res.sink_mass[0, 0, 0]).nonzero().flatten().tolist() == list(range(1, 10))
    grid = np.linspace(0, 1, 51)
    clipped = 0
    for drawn_heads in ([(0, 1), (1, 0)], [(0, 3), (1, 1)]):  # the second pair has s* < 0 (drawn at 0)
        fig = plot_convexity_curves(res, drawn_heads, measured=measured, n_queries=3)
        for ax, (layer, head) in zip(fig.axes, drawn_heads, strict=True):
            per_query = 4 if (layer, head) == (1, 0) else 3
            assert len(ax.lines) == 3 * per_query
            for k, q in enumerate([1, 5, 9]):
                a, x, c = (float(t[0, layer, head, q]) for t in (res.sq_sink, res.cross, res.sq_mean))

                def norm(s: float, a: float = a, x: float = x, c: float = c) -> float:
                    return math.sqrt(s * s * a + 2 * s * (1 - s) * x + (1 - s) ** 2 * c) / math.sqrt(c)

                lines = ax.lines[k * per_query : (k + 1) * per_query]
                np.testing.assert_allclose(lines[0].get_xdata(), grid, atol=1e-12)
                np.testing.assert_allclose(lines[0].get_ydata(), [norm(s) for s in grid], rtol=1e-6)
                s_i = float(res.sink_mass[0, layer, head, q])
                s_star = (c - x) / (a - 2 * x + c)
                clipped += not 0 <= s_star <= 1
                s_star = min(max(s_star, 0.0), 1.0)
                for line, s_pt, marker in ((lines[1], s_i, "o"), (lines[2], s_star, "x")):
                    assert line.get_marker() == marker
                    np.testing.assert_allclose(line.get_xdata(), [s_pt], rtol=1e-6, atol=1e-12)
                    np.testing.assert_allclose(line.get_ydata(), [norm(s_pt)], rtol=1e-5)
                if per_query == 4:  # the intervention's measured norms, over the same reference ‖m‖
                    np.testing.assert_allclose(lines[3].get_xdata(), [0.0, 0.5, 1.0])
                    want = meas[:, 0, 0, q].double().numpy() / math.sqrt(c)
                    np.testing.assert_allclose(lines[3].get_ydata(), want, rtol=1e-5)
        _png_size(fig)
    assert clipped >= 2

    fig = plot_sink_rate_vs_s_star(res)
    assert fig.axes[0].collections[0].get_offsets().shape == (8, 2)
    med = []
    for li, h in heads:  # median over texts and queries of s*; the lower middle value (torch.nanmedian)
        a, x, c = (t[:, li, h].flatten().double() for t in (res.sq_sink, res.cross, res.sq_mean))
        vals = sorted(v for v in ((c - x) / (a - 2 * x + c)).tolist() if math.isfinite(v))
        med.append(vals[(len(vals) - 1) // 2])
    np.testing.assert_allclose(fig.axes[0].collections[0].get_offsets(), np.c_[med, rate], rtol=1e-5)
    _png_size(fig)

    abl = sink_ablation(model, tokens, layers=[0, 1], heads=[0])
    fig = plot_cone_shift(abl)
    assert [c.get_offsets().shape[0] for c in fig.axes[0].collections] == [4, 4]
    assert abl.affected_heads == [0, 1]  # KV head 0 serves query heads 0 and 1

    def cone(cond: str) -> list[float]:
        return [float(abl.cone_cos[cond][:, layer, h].nanmean()) for layer in (0, 1) for h in (0, 1)]

    control, sink = fig.axes[0].collections
    np.testing.assert_allclose(control.get_offsets(), np.c_[cone("clean"), cone("control")], rtol=1e-6)
    np.testing.assert_allclose(sink.get_offsets(), np.c_[cone("clean"), cone("sink")], rtol=1e-6)
    assert not np.allclose(cone("sink"), cone("control"))
    _png_size(fig)


# --------------------------------------------------------------------------- summaries, head choices, convexity check


def _ref_quantile(values: list[float], p: float) -> float:
    """Linear interpolation between the order statistics (numpy's default), written out."""
    x = sorted(values)
    h = (len(x) - 1) * p
    lo = math.floor(h)
    return x[lo] if lo + 1 >= len(x) else x[lo] + (h - lo) * (x[lo + 1] - x[lo])


@pytest.mark.parametrize(
    "values",
    [[3.0, -1.0, float("nan"), 7.5, 0.25, 2.0], [5.0], [float("nan"), float("nan")], [], list(range(21))],
)
def test_describe_values_matches_order_statistics(values):
    got = describe_values(values)
    finite = [float(v) for v in values if not math.isnan(v)]
    assert got["n"] == len(finite) and isinstance(got["n"], int)
    for key, p in (("min", 0.0), ("p05", 0.05), ("median", 0.5), ("p95", 0.95), ("max", 1.0)):
        assert isinstance(got[key], float)
        if not finite:
            assert math.isnan(got[key])
        else:
            assert got[key] == pytest.approx(_ref_quantile(finite, p), rel=1e-12, abs=1e-12)
    assert describe_values(np.asarray(values, dtype=float)) == pytest.approx(got, nan_ok=True)


def _head_rates(res: SinkResult) -> dict[tuple[int, int], float]:
    """Mean sink rate of each (layer, head) over texts, by a loop."""
    out = {}
    for li, layer in enumerate(res.layers):
        for h in range(res.n_heads):
            vals = [float(x) for x in res.sink_rate[:, li, h] if not math.isnan(float(x))]
            out[(layer, h)] = sum(vals) / len(vals)
    return out


def test_head_pickers_follow_the_sink_rate_order():
    model = make_tiny(n_layers=3)
    res = sink_statistics(model, random_tokens(3, 10))
    rates = _head_rates(res)
    deep = sorted((r, key) for key, r in rates.items() if key[0] >= 1)  # ascending rate
    assert len({r for r, _ in deep}) == len(deep)  # no ties: the order is unambiguous
    for k in (1, 3, 8):
        want = [key for _, key in sorted(deep, reverse=True)[:k]]
        assert top_sink_heads(res, k) == want
    assert top_sink_heads(res, 2, min_layer=2) == [
        key for _, key in sorted(((r, key) for key, r in rates.items() if key[0] == 2), reverse=True)[:2]
    ]
    for k in (2, 3, 5):
        n = len(deep)
        want = [deep[round((n - 1) * (k - 1 - t) / (k - 1))][1] for t in range(k)]
        got = spread_sink_heads(res, k)
        assert got == want
        assert got[0] == deep[-1][1] and got[-1] == deep[0][1]  # the strongest first, the weakest last
    assert spread_sink_heads(res) == spread_sink_heads(res, 3)
    with pytest.raises(ValueError, match="no head in a layer >= 3"):
        top_sink_heads(res, 2, min_layer=3)
    with pytest.raises(ValueError, match="no head in a layer >= 1"):
        spread_sink_heads(sink_statistics(model, random_tokens(2, 6), layers=[0]))


def test_summary_matches_loops():
    model = make_tiny(n_layers=3, n_kv=2)
    res = sink_statistics(model, random_tokens(3, 10))
    s = res.summary()
    json.dumps(s)  # plain JSON types only
    rates = _head_rates(res)
    assert s["n_heads"] == len(rates) == 12 and s["n_texts"] == 3 and s["seq_len"] == 10
    assert s["sink_positions"] == [0] and s["basis"] == res.basis
    assert s["mean_sink_rate"] == pytest.approx(np.mean(list(rates.values())), rel=1e-6)
    assert s["n_sink_heads"] == sum(r >= 0.5 for r in rates.values())

    def per_head(t, li, h):  # mean over texts, NaN skipped
        vals = [float(x) for x in t[:, li, h].flatten() if not math.isnan(float(x))]
        return sum(vals) / len(vals) if vals else float("nan")

    ratio = {
        (la, h): per_head(res.norm_ratio_vt[..., 0], li, h)
        for li, la in enumerate(res.layers)
        for h in range(4)
    }
    cos_mean = {
        (la, h): per_head(res.cos_sink_mean, li, h) for li, la in enumerate(res.layers) for h in range(4)
    }
    for name, keep in (
        ("all_heads", lambda key: True),
        ("sink_heads", lambda key: rates[key] >= 0.5),
        ("layers_ge1", lambda key: key[0] >= 1),
    ):
        keys = [key for key in rates if keep(key)]
        r = [ratio[key] for key in keys]
        want = {"median": _ref_quantile(r, 0.5), "max": max(r), "n": len(r)} if r else {"n": 0}
        for k, v in want.items():
            assert s[f"norm_ratio_vt_{name}"][k] == pytest.approx(v, rel=1e-6)
        if r:
            assert s[f"share_ratio_vt_below_1_{name}"] == pytest.approx(np.mean([x < 1 for x in r]))
            assert s[f"share_ratio_vt_in_0.1_0.33_{name}"] == pytest.approx(
                np.mean([0.1 <= x <= 1 / 3 for x in r])
            )
            negative = np.mean([cos_mean[key] < 0 for key in keys])
            assert s[f"share_cos_sink_mean_negative_{name}"] == pytest.approx(negative)
    assert s["norm_ratio_vt_median"] == pytest.approx(float(np.median(list(ratio.values()))), rel=1e-6)
    assert s["share_norm_ratio_vt_below_third"] == pytest.approx(np.mean([x < 1 / 3 for x in ratio.values()]))
    assert s["mean_cos_sink_mean"] == pytest.approx(np.mean(list(cos_mean.values())), rel=1e-5)
    st_ = res.s_star()
    finite = torch.isfinite(st_)
    assert s["interior_share_pooled"] == pytest.approx(
        int(((st_ > 0) & (st_ < 1) & finite).sum()) / int(finite.sum()), rel=1e-12
    )
    shares, means, _ = res.factor_shares(pooled=True)
    for g, gname in enumerate(("sink", "tail")):
        assert s[f"factor_shares_{gname}_pooled"] == dict(
            zip(("alpha", "ratio", "cos"), shares[g].tolist(), strict=True)
        )
        assert s[f"factor_mean_log_{gname}_pooled"] == dict(
            zip(("alpha", "ratio", "cos"), means[g].tolist(), strict=True)
        )
    med = []
    for li, layer in enumerate(res.layers):  # median s* of each head over texts and queries (lower middle)
        for h in range(4):
            vals = sorted(v for v in st_[:, li, h].flatten().tolist() if math.isfinite(v))
            med.append((rates[(layer, h)], vals[(len(vals) - 1) // 2]))
    want_corr = float(np.corrcoef(np.array(med).T)[0, 1])
    assert s["corr_sink_rate_s_star_heads"] == pytest.approx(want_corr, rel=1e-6)


def test_collector_keeps_tokens_and_reads_a_cache():
    model = make_tiny(n_kv=2)
    tokens = random_tokens(2, 9)
    res = sink_statistics(model, tokens, sink_positions=[0, 2])  # one batch, as in the cache
    assert torch.equal(res.tokens, tokens) and res.str_tokens is None  # no tokenizer on the tiny model
    _, cache = model.run_with_cache(tokens)
    again = sink_statistics_from_cache(model, cache, tokens=tokens, sink_positions=[0, 2])
    assert torch.equal(again.tokens, tokens)
    for name in ("sink_rate", "norm_ratio_vt", "cos_sink_mean", "sq_sink", "cross", "sq_mean", "factor_sums"):
        torch.testing.assert_close(getattr(again, name), getattr(res, name), equal_nan=True)
    partial_layers = sink_statistics_from_cache(model, cache, layers=[1])
    assert partial_layers.layers == [1] and partial_layers.tokens is None
    col = SinkCollector(model)
    col.feed_cache(cache)
    with pytest.raises(ValueError, match="not the texts collected"):
        col.result(tokens[:1])
    assert torch.equal(col.result(tokens).tokens, tokens)
    # the ablation accepts token ids as a list (validated by to_tokens) like a tensor
    ids = tokens[0].tolist()
    a = sink_ablation(model, ids, layers=[1], mode="zero")
    b = sink_ablation(model, tokens[:1], layers=[1], mode="zero")
    torch.testing.assert_close(a.nll["sink"], b.nll["sink"])


@pytest.mark.parametrize(("sinks", "n_kv"), [([0], None), ([0, 2], 2)])
def test_convexity_check_matches_loop(sinks, n_kv):
    model = make_tiny(n_kv=n_kv)
    tokens = random_tokens(2, 10)
    heads = [(1, 3), (0, 1)]
    grid = [0.0, 0.25, 0.6, 1.0]
    stats = sink_statistics(model, tokens, sink_positions=sinks)
    check = convexity_check(model, tokens, heads, grid, stats=stats)
    # the report's loop, written out
    closed = stats.norm_curve(torch.tensor(grid, dtype=torch.float64))  # [n layer head q grid]
    rows, measured = [], {}
    for layer, head in heads:
        norms = convexity_by_intervention(
            model, tokens, grid, layer=layer, heads=[head], sink_positions=sinks
        )
        measured[(layer, head)] = (grid, norms[:, 0, head])
        for g, s in enumerate(grid):
            for b in range(tokens.shape[0]):
                m_row, c_row = norms[g, b, head], closed[b, stats.layer_index(layer), head, :, g]
                for q in torch.nonzero(torch.isfinite(m_row)).flatten().tolist():
                    rows.append(
                        {"layer": layer, "head": head, "s": s, "text": b, "query": q,
                         "norm_measured": float(m_row[q]), "norm_closed_form": float(c_row[q])}
                    )  # fmt: skip
    want = pd.DataFrame(rows)
    frame = check.to_frame()
    assert list(frame.columns) == ["layer", "head", "s", "text", "query", "norm_measured", "norm_closed_form"]
    pd.testing.assert_frame_equal(frame, want, check_exact=True)
    assert len(frame) == 2 * len(grid) * 2 * (10 - max(sinks) - 1)
    assert check.measured.keys() == measured.keys()
    for key, (s_vals, norm) in measured.items():
        assert list(check.measured[key][0]) == s_vals
        torch.testing.assert_close(check.measured[key][1], norm, rtol=0, atol=0, equal_nan=True)
    summary = check.summary()
    err = [abs(r["norm_measured"] - r["norm_closed_form"]) for r in rows]
    rel = [e / max(abs(r["norm_closed_form"]), 1e-12) for e, r in zip(err, rows, strict=True)]
    assert summary == {
        "heads": [[1, 3], [0, 1]],
        "n_points": len(rows),
        "max_rel_error": pytest.approx(max(rel), rel=1e-12),
        "max_abs_error": pytest.approx(max(err), rel=1e-12),
    }
    assert summary["max_rel_error"] < 1e-4 and summary["max_abs_error"] < 1e-4
    per_s = check.max_error_frame()
    assert len(per_s) == len(heads) * len(grid)
    for row in per_s.itertuples():
        sel = [
            e
            for e, r in zip(err, rows, strict=True)
            if (r["layer"], r["head"], r["s"]) == (row.layer, row.head, row.s)
        ]
        assert row.max_abs_err == pytest.approx(max(sel), rel=1e-12)
    # without `stats`, the statistics of the needed layers are computed: the same check
    alone = convexity_check(model, tokens, heads, grid, sink_positions=sinks)
    assert isinstance(alone.stats, ConvexityCurves) and alone.stats.layers == [0, 1]
    assert alone.stats.sink_positions == sinks and torch.equal(alone.stats.tokens, tokens)
    for name in ("sink_mass", "sq_sink", "cross", "sq_mean", "modified"):  # the statistics' own tensors
        torch.testing.assert_close(
            getattr(alone.stats, name), getattr(stats, name), rtol=0, atol=0, equal_nan=True
        )
    pd.testing.assert_frame_equal(alone.to_frame(), frame)
    with pytest.raises(ValueError, match="other tokens"):
        convexity_check(model, tokens[:1], heads, grid, stats=stats)
    with pytest.raises(ValueError, match="differ"):
        convexity_check(model, tokens, heads, grid, stats=stats, sink_positions=[1])
    with pytest.raises(ValueError, match="duplicate"):
        convexity_check(model, tokens, [(0, 1), (0, 1)], grid, stats=stats)
    with pytest.raises(IndexError, match="head"):
        convexity_check(model, tokens, [(0, 4)], grid, stats=stats)
    with pytest.raises(IndexError, match="not analysed"):
        convexity_check(model, tokens, [(1, 0)], grid, stats=sink_statistics(model, tokens, layers=[0]))
