"""The convexity curve of a padded batch (issue 35): ``convexity_by_intervention`` and ``convexity_check`` on
texts of different lengths, padded on the left or the right, give each text what it gets run alone; the sink
is each text's first real token; pads are never sinks, sources or queries, and never rows of a table.

Tiny seeded random decoders. A padded batch is built by hand from token ids with an ``attention_mask`` (the
pad id is also a real id), and through a list of texts with a stand-in tokenizer; a brute-force reference
builds one head's intervened attention row by loops at the text's own sink.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny, pad_rows, seeded_texts

from mechgeom.analyses.sinks import (
    ConvexityCurves,
    convexity_by_intervention,
    convexity_check,
    sink_statistics,
)
from mechgeom.hooks import LayerCollector, SinkPositionError, run_hooks, sink_mass_hooks

LENGTHS = [9, 5, 7]
S_VALUES = [0.0, 0.3, 0.8, 1.0]
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def one_thread(one_blas_thread):
    """A batch and a single text must meet at 1e-5 (:func:`conftest.one_blas_thread`)."""


def _texts(seed: int) -> list[torch.Tensor]:
    return seeded_texts(seed, LENGTHS)


def _padded(texts: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_rows(texts, side, pad=5)  # the pad id is a real id too


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=RTOL, atol=ATOL, equal_nan=True)


@pytest.mark.parametrize("side", ["left", "right"])
def test_measured_curve_of_a_padded_batch_is_each_text_alone(side: str) -> None:
    model = make_tiny(n_kv=2, seed=31)
    texts = _texts(32)
    tokens, mask = _padded(texts, side)
    for sinks in ([0], [0, 2]):
        got = convexity_by_intervention(
            model, tokens, s_values=S_VALUES, layer=1, sink_positions=sinks, attention_mask=mask
        )
        assert got.shape == (len(S_VALUES), len(texts), model.cfg.n_heads, tokens.shape[1])
        for b, t in enumerate(texts):
            alone = convexity_by_intervention(
                model, t[None], s_values=S_VALUES, layer=1, sink_positions=sinks
            )
            _close(got[:, b, :, : len(t)], alone[:, 0])  # positions inside the text, as alone
            assert bool(got[:, b, :, len(t) :].isnan().all())  # nothing beyond the text
            assert int((~got[:, b, 0].isnan()).sum()) == len(S_VALUES) * (len(t) - 1 - max(sinks))


@pytest.mark.parametrize("side", ["left", "right"])
def test_convexity_check_of_a_padded_batch_is_each_text_alone(side: str) -> None:
    model = make_tiny(n_kv=2, seed=33)
    texts = _texts(34)
    tokens, mask = _padded(texts, side)
    heads = [(0, 1), (1, 3)]
    check = convexity_check(model, tokens, heads=heads, s_values=S_VALUES, attention_mask=mask)
    # the closed form of the same padded batch, laid out as the sink statistics lay it out
    stats = sink_statistics(model, tokens, layers=[0, 1], attention_mask=mask)
    with_stats = convexity_check(
        model, tokens, heads=heads, s_values=S_VALUES, stats=stats, attention_mask=mask
    )
    frame, frame_stats = check.to_frame(), with_stats.to_frame()
    for b, t in enumerate(texts):
        alone = convexity_check(model, t[None], heads=heads, s_values=S_VALUES)
        for key in heads:
            _close(check.norms[key][:, b, : len(t)], alone.norms[key][:, 0])
            _close(with_stats.norms[key][:, b, : len(t)], alone.norms[key][:, 0])
            assert bool(check.norms[key][:, b, len(t) :].isnan().all())
        mine, ref = frame[frame.text == b].reset_index(drop=True), alone.to_frame()
        assert mine[["layer", "head", "s", "query"]].equals(ref[["layer", "head", "s", "query"]])
        for col in ("norm_measured", "norm_closed_form"):
            _close(torch.tensor(mine[col].to_numpy()), torch.tensor(ref[col].to_numpy()))
        assert sorted(set(mine["query"])) == list(range(1, len(t)))  # real queries in Q, inside the text
        _close(
            torch.tensor(frame_stats[frame_stats.text == b]["norm_closed_form"].to_numpy()),
            torch.tensor(ref["norm_closed_form"].to_numpy()),
        )
    assert len(frame) == len(heads) * len(S_VALUES) * sum(n - 1 for n in LENGTHS)  # no pad row
    assert check.summary()["max_rel_error"] < 1e-5 and with_stats.summary()["max_rel_error"] < 1e-5
    curves = check.stats
    assert isinstance(curves, ConvexityCurves) and curves.extras["lengths"] == LENGTHS
    for b, t in enumerate(texts):
        assert torch.equal(curves.tokens[b, : len(t)], t)  # tokens inside each text, as the statistics
    last = curves.query_frame(queries=[-1])
    assert last.groupby("text")["query"].unique().map(list).tolist() == [[n - 1] for n in LENGTHS]


def _brute_force_norm(pattern_row, v, w_o, sink: int, real: torch.Tensor, s: float) -> float:
    """``‖sum_j alpha'_j v_j W_O‖`` with the intervened row built by loops: the sink ``sink`` gets mass ``s``,
    every other real key ``j`` gets ``(1-s) alpha_j / sum_{real j != sink} alpha_j``, a pad 0."""
    rest = sum(float(pattern_row[j]) for j in range(len(pattern_row)) if bool(real[j]) and j != sink)
    z = torch.zeros(v.shape[-1], dtype=torch.float64)
    for j in range(len(pattern_row)):
        if not bool(real[j]):
            assert float(pattern_row[j]) == 0.0  # the model's mask keeps a pad out
            continue
        weight = s if j == sink else (1 - s) * float(pattern_row[j]) / rest
        z += weight * v[j].double()
    return float((z @ w_o.double()).norm())


@pytest.mark.parametrize("side", ["left", "right"])
def test_measured_norm_is_the_row_built_by_hand_at_each_texts_own_sink(side: str) -> None:
    model = make_tiny(n_kv=2, seed=35)
    texts = _texts(36)
    tokens, mask = _padded(texts, side)
    layer, head = 1, 2
    clean = LayerCollector(model, layer)
    run_hooks(model, tokens, clean.fwd_hooks, attention_mask=mask)
    acts = clean.captured[layer]  # the layer's inputs: the intervention on it does not change them
    got = convexity_by_intervention(
        model, tokens, s_values=S_VALUES, layer=layer, heads=[head], attention_mask=mask
    )
    n_checked = 0
    for b, t in enumerate(texts):
        first = int(mask[b].long().argmax())  # the sink: the text's first real token
        for i in range(first + 1, first + len(t)):  # the real queries after it, in padded positions
            for g, s in enumerate(S_VALUES):
                want = _brute_force_norm(
                    acts.pattern[b, head, i], acts.v[b, :, head], acts.W_O[head], first, mask[b], s
                )
                assert float(got[g, b, head, i - first]) == pytest.approx(want, rel=RTOL, abs=ATOL)
                n_checked += 1
    assert n_checked == len(S_VALUES) * sum(n - 1 for n in LENGTHS)


@pytest.mark.parametrize("side", ["left", "right"])
def test_sink_mass_hooks_in_a_padded_pass_leave_pads_alone(side: str) -> None:
    model = make_tiny(n_kv=2, seed=37)
    texts = _texts(38)
    tokens, mask = _padded(texts, side)
    heads, s = [0, 3], 0.7
    clean, hooked = LayerCollector(model, 0), LayerCollector(model, 0)
    run_hooks(model, tokens, clean.fwd_hooks, attention_mask=mask)
    hooks = sink_mass_hooks(model, s, layers=0, heads=heads)
    run_hooks(model, tokens, [*hooks, *hooked.fwd_hooks], attention_mask=mask)
    before, after = clean.captured[0].pattern, hooked.captured[0].pattern  # [b h q k]
    pad = ~mask
    for b in range(len(texts)):
        assert torch.equal(after[b][:, pad[b]], before[b][:, pad[b]])  # pad query rows untouched
        assert bool((after[b][:, :, pad[b]] == 0).all())  # a pad key keeps weight 0
        first = int(mask[b].long().argmax())
        real_rows = mask[b].nonzero().flatten()[1:]  # Q: the real queries after the sink
        sink_mass = after[b][heads][:, real_rows, first]
        _close(sink_mass, torch.full_like(sink_mass, s))  # the mass sits on the text's own first token
        _close(after[b][heads][:, real_rows].sum(-1), torch.ones_like(sink_mass))
        other = [h for h in range(model.cfg.n_heads) if h not in heads]
        assert torch.equal(after[b][other], before[b][other])
        assert torch.equal(after[b][:, first], before[b][:, first])  # the sink's own row is not in Q


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_list_of_texts_is_padded_on_the_tokenizers_side(side: str) -> None:
    model = make_tiny(n_kv=2, seed=39)
    model.tokenizer = SimpleNamespace(padding_side=side, pad_token_id=0, bos_token_id=1)
    model.to_tokens = lambda text, truncate=False: torch.tensor([[1] + [len(w) + 1 for w in text.split()]])
    texts = ["a bb ccc dddd eeeee ff g", "hh i jjj", "kkkk ll m nn"]  # 8, 4 and 5 tokens
    heads = [(1, 1)]
    check = convexity_check(model, texts, heads=heads, s_values=S_VALUES)
    for b, text in enumerate(texts):
        ids = model.to_tokens(text)
        alone = convexity_check(model, ids, heads=heads, s_values=S_VALUES)
        _close(check.norms[(1, 1)][:, b, : ids.shape[1]], alone.norms[(1, 1)][:, 0])
        assert bool(check.norms[(1, 1)][:, b, ids.shape[1] :].isnan().all())
    assert len(check.to_frame()) == len(S_VALUES) * (7 + 3 + 4)


def test_a_sink_beyond_a_short_text_names_the_text_and_the_way_out() -> None:
    model = make_tiny(n_kv=2, seed=41)
    tokens, mask = _padded(_texts(42), "left")
    with pytest.raises(SinkPositionError, match=r"text 1 has 5 real token\(s\).*0\.\.4.*shortest text"):
        convexity_by_intervention(
            model, tokens, s_values=[0.5], layer=0, sink_positions=[5], attention_mask=mask
        )
    with pytest.raises(SinkPositionError, match="text 1 has 5"):
        convexity_check(
            model, tokens, heads=[(0, 0)], s_values=[0.5], sink_positions=[5], attention_mask=mask
        )


def test_statistics_of_the_batch_without_its_mask_are_refused() -> None:
    """Right padding keeps the ids where they were: only the lengths tell the statistics of the padded batch
    from those of the same ids read as all real."""
    model = make_tiny(n_kv=2, seed=43)
    tokens, mask = _padded(_texts(44), "right")
    as_real = sink_statistics(model, tokens, layers=[0])
    with pytest.raises(ValueError, match=r"other tokens or another attention_mask.*attention_mask=mask"):
        convexity_check(model, tokens, heads=[(0, 0)], s_values=[0.5], stats=as_real, attention_mask=mask)
    padded = sink_statistics(model, tokens, layers=[0], attention_mask=mask)
    with pytest.raises(ValueError, match="other tokens or another attention_mask"):
        convexity_check(model, tokens, heads=[(0, 0)], s_values=[0.5], stats=padded)
    convexity_check(model, tokens, heads=[(0, 0)], s_values=[0.5], stats=padded, attention_mask=mask)
