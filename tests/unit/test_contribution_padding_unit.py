"""Padding and query subsets in contribution weights (issue 35), on tiny random models.

The reference for a padded batch is always the same texts run alone: every per-text number (table rows,
summary statistics, kept query rows) must equal the alone run's, and a batch's statistics must equal the
alone runs pooled (their ``(sum, count)`` pairs added, computed here by a brute force over Python lists).
The reference for ``queries=`` is the full computation: a kept row equals the same row of the full result.
Padding is built by hand (ids + ``attention_mask``) on the left and on the right, for decoders and encoders.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens

from mechgeom import ContributionCollector, collect, contribution_weights, head_ablation_hooks
from mechgeom.analyses.contribution.overview import contribution_overview
from mechgeom.analyses.contribution.stats import add_sums, finish_sums, score_sums
from mechgeom.hooks import run_hooks

LENGTHS = (5, 8, 3)  # three texts, one of them as long as the batch
POS = 8
DROP = ["batch"]  # the batch index differs between a batch and a text run alone


def _texts() -> list[torch.Tensor]:
    return [random_tokens(1, n, seed=40 + i)[0] for i, n in enumerate(LENGTHS)]


def _padded(texts: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    toks = torch.zeros(len(texts), POS, dtype=torch.long)
    mask = torch.zeros(len(texts), POS, dtype=torch.bool)
    where = []
    for b, t in enumerate(texts):
        sl = slice(POS - len(t), POS) if side == "left" else slice(0, len(t))
        toks[b, sl], mask[b, sl] = t, True
        where.append(sl)
    return toks, mask, where


@pytest.fixture(scope="module")
def decoder():
    return make_tiny(n_layers=2, n_kv=2, seed=3)


@pytest.fixture(scope="module")
def alone(decoder):
    return [contribution_weights(decoder, t[None]) for t in _texts()]


def _frame(res, **kw) -> pd.DataFrame:
    return res.to_frame(**kw).drop(columns=DROP).reset_index(drop=True)


# --------------------------------------------------------------------------- statistics (pure maths)


def _brute_pooled(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per head, the statistics of ``score_sums`` over every text's queries ``i >= 1``, by plain loops over
    each text's own (unpadded) ``[head, q, q]`` arrays: the definition, pooled over texts."""
    H = rows[0][0].shape[0]
    out: dict[str, list[float]] = {k: [] for k in ("sa", "svn", "sc", "neg", "top", "tv")}
    for h in range(H):
        sa, svn, sc, neg, n_fin, top, n_top, tv = [], [], [], 0, 0, 0, 0, []
        for a, vn, c in rows:
            for i in range(1, a.shape[1]):
                sa.append(a[h, i, 0])
                if not math.isnan(vn[h, i, 0]):
                    svn.append(vn[h, i, 0])
                src_c = c[h, i, : i + 1]
                if not np.isnan(src_c).all():
                    sc.append(src_c[0])
                    neg += int((src_c < 0).sum())
                    n_fin += i + 1
                    top += int(np.argmax(a[h, i, : i + 1]) == np.argmax(src_c))
                    n_top += 1
                    tv.append(0.5 * np.abs(src_c - a[h, i, : i + 1]).sum())
        out["sa"].append(np.mean(sa))
        out["svn"].append(np.mean(svn))
        out["sc"].append(np.mean(sc))
        out["neg"].append(neg / n_fin)
        out["top"].append(top / n_top)
        out["tv"].append(np.mean(tv))
    return {k: np.array(v) for k, v in out.items()}


def _random_rows(n: int, H: int, seed: int, nan_row: int | None = None):
    g = torch.Generator().manual_seed(seed)
    tril = torch.ones(n, n).tril()
    a = torch.rand(H, n, n, generator=g) * tril
    a = a / a.sum(-1, keepdim=True)
    vn = torch.rand(H, n, n, generator=g) * tril
    c = (torch.randn(H, n, n, generator=g) + 0.3) * tril
    if nan_row is not None:  # a zero output norm: NaN at its sources
        vn[0, nan_row, : nan_row + 1] = math.nan
        c[0, nan_row, : nan_row + 1] = math.nan
    return a, vn, c


@pytest.mark.parametrize("side", ["left", "right"])
def test_score_sums_of_a_padded_batch_pool_the_texts_alone(side):
    """Pads hold the values a real model would never give them (random numbers): they must not count."""
    H = 3
    texts = [_random_rows(n, H, seed=n, nan_row=2 if n > 3 else None) for n in LENGTHS]
    B = len(texts)
    batch = [torch.rand(B, H, POS, POS) * 5 for _ in range(3)]  # garbage everywhere, then the texts
    mask = torch.zeros(B, POS, dtype=torch.bool)
    for b, rows in enumerate(texts):
        n = rows[0].shape[-1]
        sl = slice(POS - n, POS) if side == "left" else slice(0, n)
        mask[b, sl] = True
        for t, x in zip(batch, rows, strict=True):
            t[b, :, sl, sl] = x
            t[b, :, sl, : sl.start] = 0.0  # a real query never weighs a pad (a left pad is before it)
    got = finish_sums(score_sums(*batch, key_mask=mask))
    acc = None
    for rows in texts:
        acc = add_sums(acc, score_sums(*(x[None] for x in rows)))
    pooled = finish_sums(acc)
    brute = _brute_pooled([tuple(x.numpy() for x in rows) for rows in texts])
    names = {
        "sa": "sink_attention",
        "svn": "sink_value_weighted_normalized",
        "sc": "sink_contribution",
        "neg": "negative_share",
        "top": "top1_agreement",
        "tv": "tv_attention_contribution",
    }
    for short, name in names.items():
        np.testing.assert_allclose(got[name].numpy(), brute[short], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(got[name].numpy(), pooled[name].numpy(), rtol=1e-5, err_msg=name)


# --------------------------------------------------------------------------- a padded batch = its texts alone


def _pooled_alone(alone) -> list[dict[str, torch.Tensor]]:
    """Per layer, the per-head statistics of the texts run alone, pooled (their (sum, count) pairs added)."""
    acc = None
    for a in alone:
        names = ("attention", "value_weighted_normalized", "contribution")
        sums = [score_sums(*(a.intra[k][:, li] for k in names)) for li in range(len(a.layers))]
        acc = sums if acc is None else [add_sums(x, y) for x, y in zip(acc, sums, strict=True)]
    return [finish_sums(x) for x in acc]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_summary_pools_the_texts_alone(decoder, alone, side):
    """The batch's statistics are over every real query of every text (the alone runs pooled), then the mean
    over heads: padding adds no query, no source and no sink."""
    toks, mask, _ = _padded(_texts(), side)
    got = contribution_weights(decoder, toks, attention_mask=mask).summary()
    pooled = _pooled_alone(alone)
    for k in ("sink_attention", "sink_contribution", "negative_share", "top1_agreement"):
        want = float(torch.cat([p[k] for p in pooled]).mean())
        assert got[k] == pytest.approx(want, rel=1e-5), k
    assert got["n_texts"] == 3 and got["n_heads"] == 8


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_table_equals_the_texts_alone(decoder, alone, side):
    toks, mask, where = _padded(_texts(), side)
    res = contribution_weights(decoder, toks, attention_mask=mask)
    for b, a in enumerate(alone):
        # the rows of the real tokens are the text alone's (padding is 0 around them)
        torch.testing.assert_close(
            res.intra["contribution"][b][..., where[b], where[b]],
            a.intra["contribution"][0],
            rtol=1e-5,
            atol=1e-6,
        )
        # the table: only real positions, numbered inside the text, as the text alone
        pd.testing.assert_frame_equal(
            _frame(res, batch=b), _frame(a), check_exact=False, rtol=1e-5, atol=1e-6
        )
        last = _frame(a, query=LENGTHS[b] - 1)
        pd.testing.assert_frame_equal(
            _frame(res, batch=b, query=-1), last, check_exact=False, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_summary_of_one_text_equals_it_alone(decoder, alone, side):
    toks, mask, _ = _padded(_texts(), side)
    res = contribution_weights(decoder, toks, attention_mask=mask)
    assert torch.equal(res.key_mask.cpu(), mask)
    for b, a in enumerate(alone):
        got, want = res.summary(batch=b), a.summary()
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    with pytest.raises(IndexError, match="batch 3 out of range"):
        res.summary(batch=3)


def test_frame_query_filter_counts_from_each_texts_end_and_names_the_range(decoder):
    toks, mask, _ = _padded(_texts(), "left")
    res = contribution_weights(decoder, toks, attention_mask=mask, layers=[0])
    df = res.to_frame(query=[-1, 0])
    for b, n in enumerate(LENGTHS):
        got = df[df["batch"] == b]
        assert sorted(set(got["query"])) == sorted({0, n - 1})
        assert len(got) == res.shape[1] * (1 + n)  # query 0 has one source, the last one n
    with pytest.raises(IndexError, match=r"text 2, which has 3 real tokens \(valid: -3..2"):
        res.to_frame(query=-4)
    with pytest.raises(IndexError, match=r"query 5 is outside text 0, which has 5 real tokens"):
        res.to_frame(query=5)


def test_collect_over_several_batches_keeps_every_batch_and_its_padding(decoder):
    toks, mask, _ = _padded(_texts(), "left")
    whole = contribution_weights(decoder, toks, attention_mask=mask)
    got = collect(decoder, toks, ContributionCollector(decoder), batch_size=2, attention_mask=mask)
    assert torch.equal(got.key_mask.cpu(), mask)
    for k, v in whole.intra.items():
        torch.testing.assert_close(got.intra[k], v, rtol=1e-5, atol=1e-6, equal_nan=True)
    pd.testing.assert_frame_equal(got.to_frame(), whole.to_frame(), check_exact=False, rtol=1e-5, atol=1e-6)
    assert got.summary() == pytest.approx(whole.summary(), rel=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_overview_of_a_padded_corpus_pools_the_texts_alone(decoder, alone, side):
    toks, mask, _ = _padded(_texts(), side)
    ov = contribution_overview(decoder, toks, attention_mask=mask, batch_size=2)
    acc = None
    for a in alone:
        sums = score_sums(
            *(a.intra[k][:, 1] for k in ("attention", "value_weighted_normalized", "contribution"))
        )
        acc = add_sums(acc, sums)
    want = finish_sums(acc)
    heads = ov.heads[ov.heads["layer"] == 1]
    for k, v in want.items():
        np.testing.assert_allclose(heads[k].to_numpy(), v.numpy(), rtol=1e-5, err_msg=k)


def test_streamed_layers_carry_the_pass_padding(decoder):
    toks, mask, _ = _padded(_texts(), "right")
    seen = {}
    col = ContributionCollector(decoder, [0], intra=["contribution"], inter=[], on_layer=seen.__setitem__)
    run_hooks(decoder, toks, col.fwd_hooks, attention_mask=mask)
    assert torch.equal(seen[0]["key_mask"].cpu(), mask) and seen[0]["query_index"] is None


# --------------------------------------------------------------------------- encoders


@pytest.mark.parametrize("side", ["left", "right"])
def test_encoder_padded_batch_equals_the_texts_alone(side):
    model = make_tiny(n_layers=2, seed=7, attention_dir="bidirectional")
    texts = _texts()
    toks, mask, _ = _padded(texts, side)
    res = contribution_weights(model, toks, attention_mask=mask)
    for b, t in enumerate(texts):
        a = contribution_weights(model, t[None])
        pd.testing.assert_frame_equal(
            _frame(res, batch=b), _frame(a), check_exact=False, rtol=1e-5, atol=1e-6
        )
        got, want = res.summary(batch=b), a.summary()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    rows = contribution_weights(model, toks, attention_mask=mask, queries=[0, -1])
    full = res.to_frame(query=[0, -1])
    pd.testing.assert_frame_equal(rows.to_frame(), full, check_exact=False, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- queries=


@pytest.mark.parametrize(
    "queries", [[-1], [0, 2, -1], slice(1, None, 2), "mask"], ids=["last", "ints", "slice", "mask"]
)
@pytest.mark.parametrize("side", ["left", "right"])
def test_kept_query_rows_equal_the_full_computation(decoder, queries, side):
    toks, mask, _ = _padded([t for t in _texts() if len(t) >= 3], side)
    if queries == "mask":
        queries = mask & (torch.arange(POS) % 2 == 0)
    full = contribution_weights(decoder, toks, attention_mask=mask)
    sub = contribution_weights(decoder, toks, attention_mask=mask, queries=queries)
    assert sub.query_index is not None and sub.query_index.shape[0] == 3
    for b in range(3):
        index = sub.query_index[b]
        real_rows = index >= 0
        assert real_rows.any()
        idx = index[real_rows]
        for k, v in full.intra.items():
            torch.testing.assert_close(
                sub.intra[k][b][:, :, real_rows], v[b][:, :, idx], rtol=1e-5, atol=1e-6, equal_nan=True, msg=k
            )
            assert (sub.intra[k][b][:, :, ~real_rows] == 0).all()
        for k, v in full.inter.items():
            torch.testing.assert_close(
                sub.inter[k][b][:, real_rows], v[b][:, idx], rtol=1e-5, atol=1e-6, equal_nan=True, msg=k
            )
    # the table of the kept rows is that of the full result filtered to them
    if isinstance(queries, list):
        want = full.to_frame(query=queries)
        pd.testing.assert_frame_equal(sub.to_frame(), want, check_exact=False, rtol=1e-5, atol=1e-6)


def test_queries_rows_and_summary_on_all_queries_equal_the_full_result(decoder):
    toks, mask, _ = _padded(_texts(), "left")
    full = contribution_weights(decoder, toks, attention_mask=mask)
    every = contribution_weights(decoder, toks, attention_mask=mask, queries=slice(None))
    assert every.summary() == pytest.approx(full.summary(), rel=1e-5)
    pd.testing.assert_frame_equal(every.to_frame(), full.to_frame(), check_exact=False, rtol=1e-5, atol=1e-6)
    # the streamed overview with queries= sees the same rows
    ov = contribution_overview(decoder, toks, attention_mask=mask, queries=[-1], batch_size=2)
    last = contribution_weights(decoder, toks, attention_mask=mask, queries=[-1])
    assert ov.summary()["sink_attention"] == pytest.approx(last.summary()["sink_attention"], rel=1e-5)


def test_queries_on_a_modified_head_mark_the_same_rows():
    model = make_tiny(n_layers=2, seed=9)
    toks = random_tokens(2, 7, seed=4)
    extra = head_ablation_hooks(model, [(1, 2)])
    full = contribution_weights(model, toks, extra_hooks=extra)
    sub = contribution_weights(model, toks, extra_hooks=extra, queries=[1, -1])
    idx = torch.tensor([1, 6])
    assert torch.equal(sub.modified, full.modified[..., idx])
    torch.testing.assert_close(sub.modified_share, full.modified_share[..., idx], rtol=1e-5, atol=1e-6)
    for k, v in full.intra.items():
        torch.testing.assert_close(sub.intra[k], v[..., idx, :], rtol=1e-5, atol=1e-6, equal_nan=True, msg=k)


def test_queries_with_collect_batches_and_a_mask_per_text(decoder):
    toks, mask, _ = _padded(_texts(), "right")
    sel = mask & (torch.arange(POS) < torch.tensor([[2], [8], [1]]))  # 2, 8 and 1 queries
    got = collect(
        decoder, toks, ContributionCollector(decoder, queries=sel), batch_size=2, attention_mask=mask
    )
    want = contribution_weights(decoder, toks, attention_mask=mask, queries=sel)
    assert torch.equal(got.query_index, want.query_index)
    assert got.query_index.tolist()[2] == [0] + [-1] * 7
    pd.testing.assert_frame_equal(got.to_frame(), want.to_frame(), check_exact=False, rtol=1e-5, atol=1e-6)


def test_bad_queries_name_the_range(decoder):
    toks, mask, _ = _padded(_texts(), "left")
    with pytest.raises(IndexError, match=r"valid: -3..2"):
        contribution_weights(decoder, toks, attention_mask=mask, queries=[3])
    with pytest.raises(TypeError, match="queries"):
        contribution_weights(decoder, toks, attention_mask=mask, queries=1.5)


# --------------------------------------------------------------------------- the table's row budget


def test_to_frame_refuses_above_its_row_budget_before_building(decoder):
    toks = random_tokens(2, 8, seed=1)
    res = contribution_weights(decoder, toks)
    n = len(res.to_frame())
    assert n == 2 * 2 * 4 * 36
    assert len(res.to_frame(max_rows=n)) == n
    with pytest.raises(ValueError, match=rf"{n:,} rows.*max_rows=100\b.*query=.*queries=\[-1\]"):
        res.to_frame(max_rows=100)
    assert len(res.to_frame(query=-1, max_rows=200)) == 2 * 2 * 4 * 8


# --------------------------------------------------------------------------- the token view


def _token_props(view) -> dict:
    src = view.panels[0][1].local_src
    m = re.search(r"CircuitsVis\.ColoredTokens,\s*(\{.*?\})\s*\)\s*</script>", src, re.S)
    assert m, "no ColoredTokens render call"
    return json.loads(m.group(1))


@pytest.mark.parametrize("side", ["left", "right"])
def test_token_view_takes_negative_queries_inside_each_text(decoder, alone, side):
    from mechgeom.viz.views import token_view

    toks, mask, _ = _padded(_texts(), side)
    res = contribution_weights(decoder, toks, attention_mask=mask)
    last = contribution_weights(decoder, toks, attention_mask=mask, queries=[-1])
    for b, a in enumerate(alone):
        want = _token_props(token_view(a, 1, LENGTHS[b] - 1, head=2))
        for r, q in ((res, -1), (res, LENGTHS[b] - 1), (last, -1)):
            got = _token_props(token_view(r, 1, q, head=2, batch=b))
            assert len(got["tokens"]) == LENGTHS[b]
            np.testing.assert_allclose(got["values"], want["values"], rtol=1e-5, atol=1e-6)
    with pytest.raises(
        IndexError, match=r"query -4 is outside text 2, which has 3 real tokens \(valid: -3..2"
    ):
        token_view(res, 1, -4, batch=2)
    with pytest.raises(IndexError, match=r"not computed.*queries \[4\]"):
        token_view(last, 1, 0, batch=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_head_and_layer_views_draw_only_the_real_tokens(decoder, alone, side):
    from mechgeom.viz.views import head_view, layer_view

    def props(view) -> dict:
        src = view.panels[0][1].local_src
        m = re.search(r"CircuitsVis\.AttentionHeads,\s*(\{.*?\})\s*\)\s*</script>", src, re.S)
        assert m, "no AttentionHeads render call"
        return json.loads(m.group(1))

    toks, mask, _ = _padded(_texts(), side)
    res = contribution_weights(decoder, toks, attention_mask=mask)
    for b, a in enumerate(alone):
        for got, want in (
            (head_view(res, 1, 2, batch=b), head_view(a, 1, 2)),
            (layer_view(res, 0, batch=b), layer_view(a, 0)),
        ):
            g, w = props(got), props(want)
            assert len(g["tokens"]) == LENGTHS[b]
            np.testing.assert_allclose(
                np.array(g["attention"]), np.array(w["attention"]), rtol=1e-5, atol=1e-6
            )
    some = contribution_weights(decoder, toks, attention_mask=mask, queries=[-1])
    with pytest.raises(ValueError, match=r"some queries only.*token_view"):
        head_view(some, 1, 2)


def test_cache_path_with_a_mask_and_queries_equals_the_live_pass(decoder):
    toks, mask, _ = _padded(_texts(), "left")
    live = contribution_weights(decoder, toks, attention_mask=mask, queries=[0, -1])
    _, cache = decoder.run_with_cache(toks, attention_mask=mask)
    cached = contribution_weights(decoder, toks, cache=cache, attention_mask=mask, queries=[0, -1])
    assert torch.equal(cached.key_mask.cpu(), mask) and torch.equal(cached.query_index, live.query_index)
    pd.testing.assert_frame_equal(cached.to_frame(), live.to_frame(), check_exact=False, rtol=1e-5, atol=1e-6)
    assert cached.summary() == pytest.approx(live.summary(), rel=1e-5)


# --------------------------------------------------------------------------- top_k=


def _brute_top(full, b: int, row_q: int, k: int, src: torch.Tensor, t: torch.Tensor):
    """The ``k`` largest ``|t|`` over the sources ``src`` of one row, by a sort: (abs values, keys)."""
    keys = src.nonzero().flatten()
    order = sorted(keys.tolist(), key=lambda j: -float(t[j].abs()))
    return [abs(float(t[j])) for j in order[:k]], order[:k]


def _check_top(full, top, mask: torch.Tensor, k: int) -> None:
    """Every row, head and metric of ``top`` against a sort of the same row of ``full`` (every query)."""
    n_batch, n_heads, pos = full.shape
    for b in range(n_batch):
        for r, q in enumerate(top.query_index[b].tolist()):
            if q < 0:
                for t in (*top.intra_keys.values(), *top.inter_keys.values()):
                    assert (t[b, ..., r, :] == -1).all()
                continue
            src = mask[b] & ((torch.arange(pos) <= q) if full.causal else True)
            n_src = int(src.sum())
            for li in range(len(full.layers)):
                cases = [(m, h) for m in full.intra for h in range(n_heads)] + [(m, None) for m in full.inter]
                for m, h in cases:
                    if h is None:
                        row, vals, keys = (
                            full.inter[m][b, li, q],
                            top.inter[m][b, li, r],
                            top.inter_keys[m][b, li, r],
                        )
                    else:
                        row, vals = full.intra[m][b, li, h, q], top.intra[m][b, li, h, r]
                        keys = top.intra_keys[m][b, li, h, r]
                    want_abs, _ = _brute_top(full, b, q, k, src, row)
                    kept = min(k, n_src)
                    assert (keys[kept:] == -1).all() and (vals[kept:] == 0).all(), (m, h)
                    assert bool(src[keys[:kept]].all()), (m, h)  # kept keys are sources
                    np.testing.assert_allclose(vals[:kept].abs().numpy(), want_abs, rtol=1e-5, atol=1e-6)
                    # each kept value is the full computation's at its key
                    torch.testing.assert_close(
                        vals[:kept], row[keys[:kept]], rtol=1e-5, atol=1e-6, equal_nan=True
                    )


@pytest.mark.parametrize("queries", [None, [0, -1]], ids=["every", "some"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_top_k_keeps_the_largest_sources_of_the_full_computation(decoder, side, queries):
    toks, mask, _ = _padded(_texts(), side)
    full = contribution_weights(decoder, toks, attention_mask=mask)
    top = contribution_weights(decoder, toks, attention_mask=mask, top_k=3, queries=queries)
    assert top.top_k == 3 and top.shape == full.shape
    assert {k: tuple(v.shape) for k, v in top.intra.items()} == {
        k: (3, 2, 4, top.query_index.shape[1], 3) for k in full.intra
    }
    assert all(top.intra_keys[k].shape == v.shape for k, v in top.intra.items())
    assert all(top.inter_keys[k].shape == v.shape for k, v in top.inter.items())
    want_rows = contribution_weights(
        decoder, toks, attention_mask=mask, queries=queries or slice(None)
    ).query_index
    assert torch.equal(top.query_index, want_rows)
    _check_top(full, top, mask, 3)


def test_top_k_on_an_encoder_and_above_the_length():
    model = make_tiny(n_layers=1, seed=7, attention_dir="bidirectional")
    toks, mask, _ = _padded(_texts(), "right")
    full = contribution_weights(model, toks, attention_mask=mask)
    top = contribution_weights(model, toks, attention_mask=mask, top_k=4)
    _check_top(full, top, mask, 4)
    every = contribution_weights(model, toks, attention_mask=mask, top_k=50)  # more than there are keys
    assert every.intra["contribution"].shape[-1] == POS
    _check_top(full, every, mask, POS)


def test_top_k_of_a_modified_head_and_its_nan_rows():
    model = make_tiny(n_layers=2, seed=9)
    toks = random_tokens(2, 7, seed=4)
    extra = head_ablation_hooks(model, [(1, 2)])
    full = contribution_weights(model, toks, extra_hooks=extra)
    top = contribution_weights(model, toks, extra_hooks=extra, top_k=2)
    assert torch.equal(top.modified, full.modified)
    torch.testing.assert_close(top.modified_share, full.modified_share, rtol=1e-5, atol=1e-6)
    nan_rows, kept = top.intra["contribution"][:, 1, 2], top.intra_keys["contribution"][:, 1, 2] >= 0
    assert kept[:, 1:].all() and kept[:, 0, 0].all() and not kept[:, 0, 1].any()  # query 0 has one source
    assert torch.isnan(nan_rows[kept]).all()  # the removed head: NaN at every source
    _check_top(full, top, torch.ones(2, 7, dtype=torch.bool), 2)


def test_top_k_table_lists_the_kept_sources_of_each_text(decoder, alone):
    toks, mask, _ = _padded(_texts(), "left")
    top = contribution_weights(
        decoder, toks, attention_mask=mask, top_k=2, intra=["contribution"], inter=["attention"]
    )
    df = top.to_frame()
    assert list(df.columns) == ["batch", "layer", "head", "query", "metric", "rank", "key", "value"]
    assert pd.api.types.is_integer_dtype(df["head"]) and pd.api.types.is_integer_dtype(df["layer"])
    assert df.loc[df["metric"] == "layer_attention", "head"].isna().all()
    for b, a in enumerate(alone):  # a text's rows: the two largest |c| of its own table, positions inside it
        want = a.to_frame()
        for (layer, head, q), grp in df[(df["batch"] == b) & (df["metric"] == "contribution")].groupby(
            ["layer", "head", "query"]
        ):
            ref = want[(want["layer"] == layer) & (want["head"] == head) & (want["query"] == q)]
            ref = ref.reindex(ref["contribution"].abs().sort_values(ascending=False).index)[:2]
            assert grp["rank"].tolist() == list(range(len(ref)))
            assert grp["key"].tolist() == ref["key"].tolist()
            np.testing.assert_allclose(grp["value"], ref["contribution"], rtol=1e-5, atol=1e-6)
    n_sources = sum(min(2, q + 1) for n in LENGTHS for q in range(n))
    assert len(df) == n_sources * 2 * (4 + 1)  # (4 heads + the layer row) per layer
    assert set(top.to_frame(heads=1)["metric"]) == {"contribution"}
    last = top.to_frame(query=-1, layers=1)
    assert last.groupby("batch")["query"].unique().map(list).tolist() == [[n - 1] for n in LENGTHS]
    with pytest.raises(ValueError, match=r"above max_rows=10\b"):
        top.to_frame(max_rows=10)


def test_top_k_collect_batches_stream_and_views(decoder):
    from mechgeom.viz.views import head_view, token_view

    toks, mask, _ = _padded(_texts(), "right")
    want = contribution_weights(decoder, toks, attention_mask=mask, top_k=2)
    got = collect(decoder, toks, ContributionCollector(decoder, top_k=2), batch_size=2, attention_mask=mask)
    for k in want.intra:
        torch.testing.assert_close(got.intra[k], want.intra[k], rtol=1e-5, atol=1e-6, equal_nan=True)
        assert torch.equal(got.intra_keys[k], want.intra_keys[k])
    seen = {}
    col = ContributionCollector(decoder, top_k=2, on_layer=lambda layer, p: seen.setdefault(layer, p))
    run_hooks(decoder, toks, col.fwd_hooks, attention_mask=mask)
    assert torch.equal(seen[1]["intra_keys"]["contribution"], want.intra_keys["contribution"][:, 1])
    # the token view draws the kept sources at their keys and 0 at the others
    full = contribution_weights(decoder, toks, attention_mask=mask)
    drawn = np.array(_token_props(token_view(want, 1, -1, head=2, batch=1))["values"])
    ref = full.intra["contribution"][1, 1, 2, LENGTHS[1] - 1].numpy()
    keep = np.argsort(-np.abs(ref))[:2]
    np.testing.assert_allclose(drawn[keep], ref[keep], rtol=1e-5, atol=1e-6)
    assert (np.delete(drawn, keep) == 0).all()
    with pytest.raises(ValueError, match=r"top_k=2 largest.*token_view"):
        head_view(want, 1, 2)
    with pytest.raises(ValueError, match=r"summary\(\) needs every source.*top_k=2"):
        want.summary()
    with pytest.raises(ValueError, match=r"special_token_frame\(\) needs every source"):
        want.special_token_frame()


def test_top_k_fits_a_budget_the_whole_result_does_not(decoder):
    from mechgeom.analyses.budget import MemoryBudgetError

    toks = random_tokens(1, 24, seed=2)
    budget = 60_000  # the full family of 2 layers at 24 tokens is ~84 kB; top_k=2 about 18 kB
    with pytest.raises(MemoryBudgetError, match=r"top_k=16"):
        contribution_weights(decoder, toks, memory_budget=budget)
    top = contribution_weights(decoder, toks, memory_budget=budget, top_k=2)
    assert top.intra["contribution"].shape[-1] == 2
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(ValueError, match=r"top_k must be a positive int"):
            contribution_weights(decoder, toks, top_k=bad)
