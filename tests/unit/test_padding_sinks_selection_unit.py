"""Padding and ``queries=`` in sinks, token selection, the taxonomy and head statistics (issue 35).

Tiny seeded random models. A padded batch is built by hand (texts of different lengths, padded on the left or
the right, with an ``attention_mask``) and every per-text number is compared with the same text run alone;
pooled numbers with the alone runs pooled; ``queries=`` with a brute-force reference on the kept queries.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny, pad_rows, seeded_texts

from mechgeom.analyses.contribution import LayerGeometry
from mechgeom.analyses.heads import classify_heads, head_stats
from mechgeom.analyses.selection import fit_bound_params, token_selection
from mechgeom.analyses.sinks import sink_statistics
from mechgeom.hooks import LayerCollector, expand_kv, hook_name

LENGTHS = [9, 5, 7]
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def one_thread(one_blas_thread):
    """A batch and a single text must meet at 1e-5 (:func:`conftest.one_blas_thread`)."""


def _texts(seed: int, lengths: list[int] = LENGTHS) -> list[torch.Tensor]:
    return seeded_texts(seed, lengths)


_padded = pad_rows


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=RTOL, atol=ATOL, equal_nan=True)


def _cache(model, tokens: torch.Tensor):
    with torch.no_grad():
        return model.run_with_cache(tokens)[1]


# --------------------------------------------------------------------------- the shared alignment


def test_align_texts_moves_each_text_to_the_start_and_keeps_queries_inside_texts() -> None:
    from mechgeom.hooks import align_texts, text_spans  # here: the other tests also run on older code

    model = make_tiny(n_kv=2, seed=1)
    texts = _texts(2)
    tokens, mask = _padded(texts, "left")
    seen = []
    reader = LayerCollector(model, [0], seen.append)
    with torch.no_grad():
        model.run_with_hooks(tokens, attention_mask=mask.long(), fwd_hooks=reader.fwd_hooks)
    acts = seen[0]
    acts.key_mask = mask
    al = align_texts(acts, [-1])
    assert al.lengths.tolist() == LENGTHS
    for b, n in enumerate(LENGTHS):
        assert al.keep[b].nonzero().flatten().tolist() == [n - 1]  # the last real token, inside the text
        alone = _cache(model, texts[b][None])
        _close(al.acts.pattern[b, :, :n, :n], alone[hook_name(0, "pattern")][0])
    with pytest.raises(ValueError, match="padding between real tokens"):
        text_spans(torch.tensor([[True, False, True]]), 1, 3)


# --------------------------------------------------------------------------- sinks


SINK_PER_TEXT = (
    "sink_rate",
    "sink_rate_pos",
    "norm_ratio_v",
    "norm_ratio_vt",
    "cos_sink_tokens",
    "cos_sink_mean",
)
SINK_PER_QUERY = ("sink_mass", "sq_sink", "cross", "sq_mean")


@pytest.mark.parametrize("side", ["left", "right"])
def test_sinks_of_a_padded_batch_are_the_texts_alone(side: str) -> None:
    model = make_tiny(n_kv=2, seed=3)
    texts = _texts(4)
    tokens, mask = _padded(texts, side, pad=7)
    res = sink_statistics(model, tokens, attention_mask=mask)
    moments = torch.zeros_like(res.factor_sums)
    for b, t in enumerate(texts):
        n = len(t)
        alone = sink_statistics(model, t[None])
        for name in SINK_PER_TEXT:
            _close(getattr(res, name)[b], getattr(alone, name)[0])
        for name in SINK_PER_QUERY:  # positions inside the text; NaN beyond it (padding is no query)
            _close(getattr(res, name)[b, ..., :n], getattr(alone, name)[0])
            assert bool(getattr(res, name)[b, ..., n:].isnan().all())
        moments += alone.factor_sums
    # pooled over the texts' real entries, as the alone runs pooled; the sums of products of logs cancel
    # (ΣX·L near 0), so their float32 activations' noise is absolute: 1e-5 beside sums of order 1e2..1e3
    torch.testing.assert_close(res.factor_sums, moments, rtol=RTOL, atol=1e-5)
    # counts: every real query after the sink, not the padded width
    n_q = (~res.sink_mass[:, 0, 0].isnan()).sum().item()
    assert n_q == sum(n - 1 for n in LENGTHS)
    q = res.query_frame(layers=[0], heads=[0])
    assert len(q) == sum(n - 1 for n in LENGTHS)
    assert q.groupby("text")["query"].max().tolist() == [n - 1 for n in LENGTHS]


def test_sink_position_0_is_the_first_real_token_with_left_padding() -> None:
    model = make_tiny(n_kv=2, seed=5)
    texts = _texts(6)
    tokens, mask = _padded(texts, "left", pad=3)
    res = sink_statistics(model, tokens, layers=[1], attention_mask=mask)
    with torch.no_grad():
        cache = model.run_with_cache(tokens, attention_mask=mask.long())[1]
    pattern = cache[hook_name(1, "pattern")].double()
    for b in range(len(LENGTHS)):
        first = int(mask[b].long().argmax())  # the first real token of text b in the padded batch
        expect = pattern[b, :, first + 1 :, first].mean(-1)  # mean over the real queries after it
        _close(res.sink_rate[b, 0], expect)


def test_sink_queries_keep_only_the_prediction_row_and_match_a_brute_force_reference() -> None:
    model = make_tiny(n_kv=2, seed=7)
    texts = _texts(8)
    tokens, mask = _padded(texts, "left")
    last = sink_statistics(model, tokens, attention_mask=mask, queries=[-1])
    for b, t in enumerate(texts):
        n = len(t)
        alone = sink_statistics(model, t[None])
        kept = ~last.sink_mass[b, 0, 0].isnan()
        assert kept.nonzero().flatten().tolist() == [n - 1]  # queries=[-1]: the last real token of each text
        for name in SINK_PER_QUERY:
            _close(getattr(last, name)[b, ..., n - 1], getattr(alone, name)[0, ..., n - 1])
        _close(last.sink_rate[b], alone.sink_mass[0, ..., n - 1].float())  # the mean over one query
        for name in ("norm_ratio_vt", "cos_sink_tokens"):  # no query axis: every token of the text
            _close(getattr(last, name)[b], getattr(alone, name)[0])
    # brute force: the factor moments of some queries of one text, from the full LayerGeometry's factors
    text = texts[0][None]
    keep = [2, 5, 8]
    sub = sink_statistics(model, text, queries=keep)
    cache = _cache(model, text)
    for li in range(model.cfg.n_layers):
        geo = LayerGeometry(
            cache[hook_name(li, "pattern")],
            expand_kv(cache[hook_name(li, "v")], model.cfg.n_heads),
            cache[hook_name(li, "z")],
            model.W_O[li].detach(),
        )
        xs = [geo.pattern.log(), geo.factor_norm_ratio().log(), geo.factor_cos().abs().log()]
        big_l = geo.contribution().abs().log()
        for h in range(model.cfg.n_heads):
            for g, cols in enumerate(([0], None)):
                n = 0
                sums = torch.zeros(9, dtype=torch.float64)
                for i in keep:
                    for j in [0] if cols else range(1, i + 1):
                        vals = [float(x[0, h, i, j]) for x in xs]
                        lv = float(big_l[0, h, i, j])
                        if not all(map(torch.isfinite, map(torch.tensor, [*vals, lv]))):
                            continue
                        n += 1
                        sums += torch.tensor(
                            [1, *vals, lv, *(v * lv for v in vals), lv * lv], dtype=torch.float64
                        )
                assert n == int(sub.factor_sums[li, h, g, 0])
                torch.testing.assert_close(sub.factor_sums[li, h, g], sums, rtol=1e-5, atol=1e-5)
        # the sink rate over the kept queries, by loops
        for h in range(model.cfg.n_heads):
            rate = torch.tensor([float(cache[hook_name(li, "pattern")][0, h, i, 0]) for i in keep]).mean()
            _close(sub.sink_rate[0, li, h], rate)


def _encoder(seed: int):
    model = make_tiny(attention_dir="bidirectional", seed=seed, n_kv=2)
    ids = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3}
    model.tokenizer = SimpleNamespace(
        pad_token_id=0, unk_token_id=3, unk_token="[UNK]", convert_tokens_to_ids=lambda t: ids.get(t, 3)
    )
    model.to_str_tokens = lambda row: [str(int(t)) for t in row]
    return model


@pytest.mark.parametrize("side", ["left", "right"])
def test_encoder_sinks_of_a_padded_batch_are_the_texts_alone(side: str) -> None:
    model = _encoder(11)
    texts = [torch.cat([torch.tensor([1]), t % 40 + 4, torch.tensor([2])]) for t in _texts(12, [5, 3, 4])]
    tokens, mask = _padded(texts, side)
    res = sink_statistics(model, tokens, attention_mask=mask, sink_positions=["[CLS]", "[SEP]"])
    last = sink_statistics(model, tokens, attention_mask=mask, sink_positions=[0], queries=[-1])
    for b, t in enumerate(texts):
        alone = sink_statistics(model, t[None], sink_positions=["[CLS]", "[SEP]"])
        for name in SINK_PER_TEXT:
            _close(getattr(res, name)[b], getattr(alone, name)[0])
        _close(res.sink_mass[b, ..., : len(t)], alone.sink_mass[0])
        assert res.extras["sink_positions_per_text"][b] == [0, len(t) - 1]  # inside the text
        one = sink_statistics(model, t[None], sink_positions=[0])
        _close(last.sink_mass[b, ..., len(t) - 1], one.sink_mass[0, ..., len(t) - 1])
        assert int((~last.sink_mass[b, 0, 0].isnan()).sum()) == 1


# --------------------------------------------------------------------------- taxonomy and head statistics


@pytest.mark.parametrize("side", ["left", "right"])
def test_taxonomy_of_a_padded_batch_pools_the_texts_alone(side: str) -> None:
    model = make_tiny(n_kv=2, seed=13)
    texts = _texts(14)
    tokens, mask = _padded(texts, side, pad=5)
    res = classify_heads(model, tokens, attention_mask=mask, keep_winners=True)
    alone = [classify_heads(model, t[None], keep_winners=True) for t in texts]
    for key in res.sums:
        _close(res.sums[key], sum(a.sums[key] for a in alone))
    assert int(res.sums["n_queries"][0, 0]) == sum(n - 1 for n in LENGTHS)  # real queries, not 3 x 8
    for b, (t, a) in enumerate(zip(texts, alone, strict=True)):
        assert torch.equal(res.winners[b, ..., : len(t)], a.winners[0])  # positions inside each text
        assert torch.equal(res.tokens[b, : len(t)], t)  # the tokens too
        assert bool((res.winners[b, ..., len(t) :] == -1).all())


def test_taxonomy_queries_count_only_the_kept_queries_by_brute_force() -> None:
    model = make_tiny(n_kv=2, seed=15)
    texts = _texts(16)
    tokens, mask = _padded(texts, "left")
    last = classify_heads(model, tokens, attention_mask=mask, queries=[-1])
    assert int(last.sums["n_queries"][0, 0]) == len(texts)
    n_cur = torch.zeros_like(last.sums["n_cur"])
    n_sink = torch.zeros_like(n_cur)
    for t in texts:
        cache = _cache(model, t[None])
        i = len(t) - 1
        for li in range(model.cfg.n_layers):
            pattern = cache[hook_name(li, "pattern")][0]
            v = expand_kv(cache[hook_name(li, "v")], model.cfg.n_heads)[0]
            for h in range(model.cfg.n_heads):
                scores = [float(pattern[h, i, j]) * float(v[j, h].norm()) for j in range(i + 1)]
                w = max(range(i + 1), key=lambda j: (scores[j], -j))  # ties: the lower position
                n_cur[li, h] += w == i
                n_sink[li, h] += w == 0
    _close(last.sums["n_cur"], n_cur)
    _close(last.sums["n_sink"], n_sink)


@pytest.mark.parametrize("side", ["left", "right"])
def test_head_stats_of_a_padded_batch_average_real_positions_only(side: str) -> None:
    model = make_tiny(n_kv=2, seed=17)
    texts = _texts(18)
    tokens, mask = _padded(texts, side)
    res = head_stats(model, tokens, attention_mask=mask, taxonomy=False)
    alone = [head_stats(model, t[None], taxonomy=False) for t in texts]
    total = sum(a.n_positions for a in alone)
    assert res.n_positions == total == sum(LENGTHS)
    for name in ("z_mean", "out_norm", "entropy"):
        pooled = sum(getattr(a, name).double() * a.n_positions for a in alone) / total
        _close(getattr(res, name), pooled)


# --------------------------------------------------------------------------- token selection


SEL_PER_QUERY = ("f_top", "f_nosink", "certificate", "m_inv", "q_inv", "sink_in_top")


@pytest.mark.parametrize("side", ["left", "right"])
def test_selection_of_a_padded_batch_is_the_texts_alone(side: str) -> None:
    model = make_tiny(n_kv=2, seed=19)
    texts = _texts(20)
    tokens, mask = _padded(texts, side, pad=9)
    kw = dict(ns=[1, 2, 4], n_random=0, dtype=torch.float64)
    res = token_selection(model, tokens, attention_mask=mask, **kw)
    for b, t in enumerate(texts):
        n = len(t)
        alone = token_selection(model, t[None], **kw)
        for name in SEL_PER_QUERY:
            _close(res.per_query[name][b, ..., :n, :], alone.per_query[name][0])
            assert bool(res.per_query[name][b, ..., n:, :].isnan().all())
        assert torch.equal(res.tokens[b, :n], t)  # tokens at positions inside each text, as the query axis
    s = res.summary()
    assert s["n_queries"] == sum(LENGTHS)  # real queries only, not 3 x 9
    assert s["queries_per_text"] == LENGTHS
    assert int(res.to_frame().query("N == 1")["n_queries"].iloc[0]) == sum(LENGTHS)
    # the bound's parameters pool every text's real tokens: extremes over the texts alone
    with torch.no_grad():
        for li in range(model.cfg.n_layers):
            fits = []
            for t in texts:
                v = expand_kv(_cache(model, t[None])[hook_name(li, "v")], model.cfg.n_heads)
                fits.append(fit_bound_params(v, [0]))
            for name, op in (("nu_min", torch.minimum), ("nu_max", torch.maximum), ("mu", torch.maximum)):
                expect = fits[0].as_dict()[name]
                for f in fits[1:]:
                    expect = op(expect, f.as_dict()[name])
                _close(res.params[name][li], expect.float())
            kappa = torch.stack([f.kappa for f in fits]).min(0).values
            _close(res.params["kappa"][li], kappa.float())


def test_selection_queries_last_row_is_the_text_alone() -> None:
    model = make_tiny(n_kv=2, seed=21)
    texts = _texts(22)
    tokens, mask = _padded(texts, "left")
    kw = dict(ns=[1, 2], n_random=0, bound=False, dtype=torch.float64)
    last = token_selection(model, tokens, attention_mask=mask, queries=[-1], **kw)
    assert last.summary()["n_queries"] == len(texts)
    for b, t in enumerate(texts):
        alone = token_selection(model, t[None], **kw)
        kept = ~last.per_query["f_top"][b, 0, 0, :, 0].isnan()
        assert kept.nonzero().flatten().tolist() == [len(t) - 1]
        for name in SEL_PER_QUERY:
            _close(last.per_query[name][b, ..., len(t) - 1, :], alone.per_query[name][0, ..., len(t) - 1, :])


def test_sink_query_frame_takes_negative_query_indices_inside_each_text() -> None:
    model = make_tiny(n_kv=2, seed=23)
    texts = _texts(24)
    tokens, mask = _padded(texts, "left")
    res = sink_statistics(model, tokens, layers=[0], attention_mask=mask)
    assert res.extras["lengths"] == LENGTHS
    assert torch.equal(res.tokens[1, : LENGTHS[1]], texts[1])  # tokens at positions inside each text
    rows = res.query_frame(heads=[0], queries=[-1, -2])
    assert rows.groupby("text")["query"].apply(sorted).tolist() == [[n - 2, n - 1] for n in LENGTHS]
    for b, n in enumerate(LENGTHS):
        got = rows[(rows.text == b) & (rows["query"] == n - 1)]["sink_mass"].item()
        assert got == pytest.approx(float(res.sink_mass[b, 0, 0, n - 1]))
    with pytest.raises(IndexError, match="outside text 1"):
        res.query_frame(queries=[-6])


@pytest.mark.parametrize("side", ["left", "right"])
def test_rollout_of_a_padded_batch_is_the_texts_alone(side: str) -> None:
    from mechgeom.analyses.attribution.rollout import attention_rollout

    model = make_tiny(n_kv=2, seed=27)
    texts = _texts(28)
    tokens, mask = _padded(texts, side, pad=4)
    res = attention_rollout(model, tokens, attention_mask=mask)
    alone = [attention_rollout(model, t[None]) for t in texts]
    frame = res.to_frame()
    for b, (t, a) in enumerate(zip(texts, alone, strict=True)):
        s = int(mask[b].long().argmax())
        _close(res.scores[b, :, s : s + len(t), s : s + len(t)], a.scores[0])
        rows = frame[frame.batch == b]
        assert rows["query"].max() == len(t) - 1 and rows["key"].min() == 0  # positions inside the text
        _close(torch.tensor(rows["rollout"].to_numpy()), torch.tensor(a.to_frame()["rollout"].to_numpy()))
    # pooled over the real queries of every text, as the alone runs pooled
    n_after = sum(len(t) - 1 for t in texts)
    first = sum(
        torch.tensor(a.summary()["first_token_share"]) * (len(t) - 1)
        for a, t in zip(alone, texts, strict=True)
    )
    own = sum(torch.tensor(a.summary()["self_share"]) * len(t) for a, t in zip(alone, texts, strict=True))
    _close(torch.tensor(res.summary()["first_token_share"]), first / n_after)
    _close(torch.tensor(res.summary()["self_share"]), own / sum(LENGTHS))
