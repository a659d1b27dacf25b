"""mechgeom.analyses.sinks.statistics on SmolLM2-135M: references, the convexity intervention, GQA ablation, real-model sink geometry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mechgeom.analyses.sinks import convexity_by_intervention, convexity_check, sink_ablation
from mechgeom.analyses.sinks.statistics import SinkResult, sink_statistics, top_sink_heads
from mechgeom.hooks import LayerCollector, affected_heads, hook_name, run_hooks, sink_value_hooks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stats(smollm2, smollm2_windows) -> SinkResult:
    return sink_statistics(smollm2, smollm2_windows[:2])


def test_statistics_match_reference_smollm2(smollm2, smollm2_windows):
    """Loops over heads and queries (vectorised over sources only), float64, on one layer."""
    tokens, layer = smollm2_windows[:1, :24], 4
    res = sink_statistics(smollm2, tokens, layers=[layer])
    names = [hook_name(layer, k) for k in ("pattern", "v", "z")]
    with torch.no_grad():
        _, cache = smollm2.run_with_cache(tokens, names_filter=names, stop_at_layer=layer + 1)
    pattern = cache[names[0]][0].double()
    # GQA written from the config: query head h reads KV head h // (n_heads // n_key_value_heads)
    n_heads, n_kv = int(smollm2.cfg.n_heads), int(smollm2.cfg.n_key_value_heads)
    kv_of = torch.tensor([h // (n_heads // n_kv) for h in range(n_heads)])
    assert kv_of.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    v = cache[names[1]][0].double()[:, kv_of]  # [k head d_head]
    z = cache[names[2]][0].double()
    # the mapping is TransformerLens' own: z[i,h] = sum_j pattern[h,i,j] v[j,h] reproduces hook_z
    torch.testing.assert_close(torch.einsum("hqk,khd->qhd", pattern, v), z, atol=1e-5, rtol=1e-4)
    W_O = smollm2.W_O[layer].detach().double()
    s_star = res.s_star()
    shares = res.factor_shares()[0]
    for h in range(smollm2.cfg.n_heads):
        vt = v[:, h] @ W_O[h]  # [k d_model]
        o = z[:, h] @ W_O[h]  # [q d_model]
        alpha = pattern[h]
        assert float(res.sink_rate[0, 0, h]) == pytest.approx(float(alpha[1:, 0].mean()), rel=1e-5)
        assert float(res.norm_ratio_v[0, 0, h, 0]) == pytest.approx(
            float(v[0, h].norm() / v[1:, h].norm(dim=-1).mean()), rel=1e-5
        )
        ratio_vt = float(vt[0].norm() / vt[1:].norm(dim=-1).mean())
        assert float(res.norm_ratio_vt[0, 0, h, 0]) == pytest.approx(ratio_vt, rel=1e-5)
        cos_tok = torch.nn.functional.cosine_similarity(vt[:1], vt[1:], dim=-1).mean()
        assert float(res.cos_sink_tokens[0, 0, h, 0]) == pytest.approx(float(cos_tok), abs=1e-5)
        cos_q, rows = [], {"sink": [], "tail": []}
        for i in range(1, 24):
            m = (alpha[i, 1 : i + 1, None] * vt[1 : i + 1]).sum(0) / alpha[i, 1 : i + 1].sum()
            a, x, c = float(vt[0] @ vt[0]), float(vt[0] @ m), float(m @ m)
            cos_q.append(x / math.sqrt(a * c))
            assert float(s_star[0, 0, h, i]) == pytest.approx((c - x) / (a - 2 * x + c), rel=1e-4, abs=1e-6)
            assert float(res.sink_mass[0, 0, h, i]) == pytest.approx(float(alpha[i, 0]), rel=1e-6)
            ratio = vt[: i + 1].norm(dim=-1) / o[i].norm()
            cos = torch.nn.functional.cosine_similarity(o[i : i + 1], vt[: i + 1], dim=-1)
            contrib = (vt[: i + 1] @ o[i]) * alpha[i, : i + 1] / (o[i] @ o[i])
            logs = torch.stack(
                [alpha[i, : i + 1].log(), ratio.log(), cos.abs().log(), contrib.abs().log()], -1
            )
            rows["sink"].append(logs[:1])
            rows["tail"].append(logs[1:])
        assert float(res.cos_sink_mean[0, 0, h]) == pytest.approx(float(np.mean(cos_q)), abs=1e-5)
        for g, name in enumerate(("sink", "tail")):
            x_all = torch.cat(rows[name]).numpy()
            x_all = x_all[np.isfinite(x_all).all(1)]
            big_l = x_all[:, 3]
            want = [
                np.mean((x_all[:, f] - x_all[:, f].mean()) * (big_l - big_l.mean())) / big_l.var()
                for f in range(3)
            ]
            np.testing.assert_allclose(shares[0, h, g].numpy(), want, atol=1e-3)


def test_closed_form_matches_intervention_smollm2(smollm2, smollm2_windows, stats):
    tokens = smollm2_windows[:2]
    grid = [0.0, 0.3, 0.7, 1.0]
    closed = stats.norm_curve(grid)
    for layer in (1, 9):
        meas = convexity_by_intervention(smollm2, tokens, grid, layer=layer)
        for k in range(len(grid)):
            want = closed[:, layer, :, :, k]
            finite = torch.isfinite(want)
            assert finite[:, :, 1:].all()
            assert float((meas[k] - want).abs()[finite].max()) < 1e-4
        assert float((meas[0] - meas[-1]).abs()[torch.isfinite(meas[0])].max()) > 0.1


def test_smollm2_sink_geometry(stats):
    """SmolLM2's first token is a sink with a small, anti-aligned value (paper B), and norm minima are
    interior for most (head, query) pairs (paper A)."""
    df = stats.to_frame()
    deep = df[df["layer"] >= 1]
    assert deep["sink_rate"].median() > 0.3
    assert deep["norm_ratio_v"].median() < 0.5 and deep["norm_ratio_vt"].median() < 0.5
    assert (deep["norm_ratio_vt"] < 1).mean() > 0.8
    assert (deep["cos_sink_tokens"] < 0).mean() > 0.5
    assert float(stats.interior_share(pooled=True)) > 0.7


def test_summary_and_convexity_check_smollm2(smollm2, smollm2_windows, stats):
    """The headline numbers restate the table (SmolLM2: small, anti-aligned sinks, interior minima), and the
    report's convexity check on its top sink heads matches the closed form."""
    s = stats.summary()
    deep = stats.to_frame()
    deep = deep[deep["layer"] >= 1]
    assert s["n_heads"] == 30 * 9 and s["n_texts"] == 2 and s["seq_len"] == 64
    assert s["norm_ratio_vt_layers_ge1"]["median"] == pytest.approx(float(deep["norm_ratio_vt"].median()))
    assert s["norm_ratio_vt_layers_ge1"]["median"] < 0.5 and s["share_ratio_vt_below_1_layers_ge1"] > 0.8
    assert s["share_cos_sink_tokens_negative_layers_ge1"] > 0.5 and s["interior_share_pooled"] > 0.7
    assert s["sink_rate_per_head"]["median"] > 0.3 and s["n_sink_heads"] > 0
    shares = s["factor_shares_tail_pooled"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)
    heads = top_sink_heads(stats, 2)
    rates = deep.set_index(["layer", "head"])["sink_rate"]
    assert [rates[h] for h in heads] == sorted(rates, reverse=True)[:2]
    check = convexity_check(smollm2, smollm2_windows[:2], heads, [0.0, 0.5, 1.0], stats=stats)
    summary = check.summary()
    assert summary["heads"] == [list(h) for h in heads] and summary["n_points"] == 2 * 3 * 2 * 63
    assert summary["max_rel_error"] < 1e-4


def test_gqa_ablation_and_identity_smollm2(smollm2, smollm2_windows):
    tokens = smollm2_windows[:1, :32]
    clean = run_hooks(smollm2, tokens, [], return_type="logits")
    same = run_hooks(
        smollm2, tokens, sink_value_hooks(smollm2, mode="scale", scale=1.0), return_type="logits"
    )
    assert torch.equal(same, clean)
    assert affected_heads(smollm2, [4]) == [3, 4, 5]

    def z_at(hooks):
        col = LayerCollector(smollm2, 3)
        run_hooks(smollm2, tokens, [*hooks, *col.fwd_hooks], stop_at_layer=4)
        return col.captured[3].z

    z0, z1 = z_at([]), z_at(sink_value_hooks(smollm2, layers=3, heads=[4]))
    changed = [h for h in range(9) if not torch.equal(z0[:, :, h], z1[:, :, h])]
    assert changed == [3, 4, 5]


def test_sink_ablation_smollm2(smollm2, smollm2_windows):
    res = sink_ablation(smollm2, smollm2_windows[:2], mode="zero", batch_size=2)
    s = res.summary(n_boot=100)
    assert res.affected_heads == list(range(9))
    assert s["dnll_sink"] > s["dnll_control"] + 0.05
    assert s["ppl_clean"] == pytest.approx(res.ppl("clean"))
