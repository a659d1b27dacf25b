"""Token-selection geometry and the head taxonomy on the real SmolLM2-135M (short windows)."""

from __future__ import annotations

import math

import pytest
import torch

from mechgeom.analyses.heads.taxonomy import classify_heads, classify_heads_from_cache, regime_summary
from mechgeom.analyses.selection.collector import token_selection, token_selection_from_cache
from mechgeom.hooks import has_hooks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def short(smollm2_windows: torch.Tensor) -> torch.Tensor:
    return smollm2_windows[:2, :48]


@pytest.fixture(scope="module")
def selection(smollm2, short):  # type: ignore[no-untyped-def]
    return token_selection(smollm2, short, n_random=1)


def test_certificate_and_bound_hold_on_every_head(selection) -> None:  # type: ignore[no-untyped-def]
    frame = selection.to_frame()
    assert len(frame) == 30 * 9 * 6
    assert (frame.cert_violations == 0).all()
    assert (frame.bound_violations == 0).all()  # the parameters are fitted by their extremes
    f = selection.per_query["f_top"]
    ok = ~torch.isnan(f)
    for name in ("certificate", "bound"):
        assert (selection.per_query[name][ok] <= f[ok] + 1e-6).all()
    assert ((f[ok] > 0) & (f[ok] <= 1)).all()
    # paper B: top-N sets are more separable than random N-subsets at small and intermediate N
    by_n = frame.groupby("N")[["f_top", "f_random"]].mean()
    assert (by_n.loc[[2, 4, 8], "f_top"] > by_n.loc[[2, 4, 8], "f_random"] + 0.05).all()
    params = selection.params_frame()
    assert (params.rho > 0).all() and (params.mu <= 1 + 1e-6).all()


def gqa_values(model, cache, layer: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``v`` of every query head, ``[batch, pos, head, d_head]`` float64, written from the config: query head
    ``h`` reads KV head ``h // (n_heads // n_key_value_heads)``. Pinned to TransformerLens' own ``hook_z``."""
    n_heads, n_kv = int(model.cfg.n_heads), int(model.cfg.n_key_value_heads)
    assert (n_heads, n_kv) == (9, 3)
    kv_of = torch.tensor([h // (n_heads // n_kv) for h in range(n_heads)])
    assert kv_of.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    v = cache[f"blocks.{layer}.attn.hook_v"].double()[:, :, kv_of]
    pat = cache[f"blocks.{layer}.attn.hook_pattern"].double()
    z = torch.einsum("bhqk,bkhd->bqhd", pat, v)
    torch.testing.assert_close(z, cache[f"blocks.{layer}.attn.hook_z"].double(), atol=1e-5, rtol=1e-4)
    return v


def test_real_head_matches_bruteforce(smollm2, short, selection) -> None:  # type: ignore[no-untyped-def]
    layer, queries = 3, [10, 30, 47]
    _, cache = smollm2.run_with_cache(short[:1], names_filter=lambda n: n.startswith(f"blocks.{layer}.attn"))
    v_all = gqa_values(smollm2, cache, layer)[0]
    # heads 2, 4 and 7 read KV heads 0, 1, 2; a tiled mapping (h % 3) would give 2, 1, 1
    for head in (2, 4, 7):
        pat = cache[f"blocks.{layer}.attn.hook_pattern"][0, head].double()
        v = v_all[:, head]
        for t, n in enumerate(selection.ns[:4]):
            for i in queries:
                top = sorted(range(i + 1), key=lambda j: (-pat[i, j].item(), j))[:n]
                y = pat[i, : i + 1, None] * v[: i + 1]
                s = y[top].sum(0)
                d = (y - s).norm(dim=-1).tolist()
                best = 0.0
                for r in d:
                    tp = sum(1 for j in top if d[j] <= r)
                    size = sum(1 for x in d if x <= r)
                    best = max(best, 2 * tp / (n + size))
                got = selection.per_query["f_top"][0, layer, head, i, t].item()
                assert got == pytest.approx(best, abs=1e-4), (head, n, i)


def test_projected_space_on_real_layer(smollm2, short) -> None:  # type: ignore[no-untyped-def]
    _, cache = smollm2.run_with_cache(short[:1], names_filter=lambda n: n.startswith("blocks.5.attn"))
    res = token_selection_from_cache(smollm2, cache, layers=[5], projected=True, ns=[2, 8], n_random=1)
    frame = res.to_frame()
    assert (frame.cert_violations == 0).all() and (frame.bound_violations == 0).all()
    assert frame.f_top.between(0, 1).all()


def test_taxonomy_on_smollm2(smollm2, smollm2_windows) -> None:  # type: ignore[no-untyped-def]
    res = classify_heads(smollm2, smollm2_windows, batch_size=2)
    table = res.to_frame()
    assert len(table) == 270
    assert table[["f_cur", "f_sink", "f_other"]].sum(axis=1).sub(1).abs().max() < 1e-9
    summary = regime_summary(table).set_index("label")
    # paper B: Retrievers are a minority
    assert 0 < summary.loc["Retriever", "share"] < 0.3
    # Mixers put mass on the sink and their output aligns with its value; Retrievers with the current token
    assert summary.loc["Mixer", "sink_rate"] > summary.loc["Retriever", "sink_rate"]
    assert summary.loc["Mixer", "cos_out_sink"] > summary.loc["Retriever", "cos_out_sink"]
    assert summary.loc["Retriever", "cos_out_cur"] > summary.loc["Mixer", "cos_out_cur"]
    _, cache = smollm2.run_with_cache(
        smollm2_windows[:2], names_filter=lambda n: n.startswith("blocks.7.attn")
    )
    a = classify_heads_from_cache(smollm2, cache, layers=[7]).to_frame()
    b = classify_heads(smollm2, smollm2_windows[:2], layers=[7]).to_frame()
    assert a["label"].tolist() == b["label"].tolist()
    assert not math.isnan(a.cos_out_sink.mean())
    assert not has_hooks(smollm2)
