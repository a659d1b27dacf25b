"""Padding and query selection in the core (issue 35): the mask of real tokens from the input
(:func:`to_batch`), through the pass (:func:`run_hooks`, :func:`run_batches`, :func:`pass_mask`) to every
reader (:attr:`LayerActivations.key_mask`), and the one definition of ``queries=`` (:func:`select_queries`).

Each analysis has its own padding tests; these check the plumbing they all stand on, on tiny random models
(left and right padding, both TransformerLens lines).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mechgeom import contribution_weights
from mechgeom.analyses.base import collect
from mechgeom.analyses.contribution.weights import ContributionCollector
from mechgeom.hooks import (
    LayerCollector,
    pad_texts,
    pass_mask,
    run_batches,
    run_hooks,
    select_queries,
    text_positions,
    to_batch,
)
from tests.conftest import make_tiny


def _padded(rows: list[list[int]], side: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as one batch, padded on ``side`` with ``pad``, and its mask of real tokens."""
    n = max(len(r) for r in rows)
    tokens = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, r in enumerate(rows):
        cols = slice(0, len(r)) if side == "right" else slice(n - len(r), n)
        tokens[b, cols] = torch.tensor(r)
        mask[b, cols] = True
    return tokens, mask


ROWS = [[3, 7, 1, 9], [5, 2, 8, 4, 6, 11, 12, 3, 1], [13, 14]]


class _FakeTokenizer:
    """A tokenizer stand-in: a text is its words' lengths + 1 as ids (so lengths differ by text)."""

    pad_token_id = 0

    def __init__(self, side: str) -> None:
        self.padding_side = side


def _fake_model(side: str) -> SimpleNamespace:
    tok = _FakeTokenizer(side)

    def to_tokens(text: str, truncate: bool = False) -> torch.Tensor:
        return torch.tensor([[1] + [len(w) + 1 for w in text.split()]])

    return SimpleNamespace(
        cfg=SimpleNamespace(d_vocab=50, n_ctx=32, device="cpu", attention_dir="causal"),
        tokenizer=tok,
        to_tokens=to_tokens,
    )


@pytest.mark.parametrize("side", ["left", "right"])
def test_texts_are_padded_on_the_tokenizers_side_with_a_mask_from_their_lengths(side: str) -> None:
    model = _fake_model(side)
    texts = ["a bb", "ccc dddd eeeee ff"]
    tokens, mask = to_batch(model, texts)
    alone = [model.to_tokens(t)[0] for t in texts]
    assert mask is not None and mask.sum(-1).tolist() == [len(a) for a in alone]
    for b, a in enumerate(alone):
        assert tokens[b][mask[b]].tolist() == a.tolist()  # each text's ids, in order, where the mask says
        assert bool(mask[b, -1] if side == "left" else mask[b, 0])
    assert torch.equal(pad_texts(model, texts)[0], tokens)
    # the pad id is also a real id here (0 is not used by the fake tokenizer, but a real tokenizer's pad is
    # often its end-of-text): the mask never comes from the ids
    assert to_batch(model, ["a b", "c d"])[1] is None  # same lengths: nothing is padding


def test_a_given_mask_wins_and_is_checked() -> None:
    model = _fake_model("right")
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    _, mask = to_batch(model, tokens, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert mask is not None and mask.tolist() == [[False, True, True], [True, True, True]]
    assert to_batch(model, tokens)[1] is None  # ids alone are all real: a pad id may be a real token
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 2\), but the tokens are \(2, 3\)"):
        to_batch(model, tokens, attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="fewer than 2 real token"):
        to_batch(model, tokens, attention_mask=torch.tensor([[0, 0, 1], [1, 1, 1]]), min_pos=2)


def test_text_positions() -> None:
    mask = torch.tensor([[False, False, True, True], [True, True, True, False]])
    assert text_positions(mask, 2, 4).tolist() == [[-1, -1, 0, 1], [0, 1, 2, -1]]
    assert text_positions(None, 1, 3).tolist() == [[0, 1, 2]]


class TestSelectQueries:
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])

    def test_negative_positions_count_from_each_texts_end(self) -> None:
        sel = select_queries([-1], self.mask, 2, 5)
        assert sel.nonzero().tolist() == [[0, 4], [1, 4]]
        sel = select_queries([0, -2], self.mask, 2, 5)  # the first real token and the one before the last
        assert sel.nonzero().tolist() == [[0, 2], [0, 3], [1, 0], [1, 3]]

    def test_slice_is_over_positions_in_each_text(self) -> None:
        assert select_queries(slice(1, None), self.mask, 2, 5).sum(-1).tolist() == [2, 4]
        assert select_queries(slice(-1, None), self.mask, 2, 5).nonzero().tolist() == [[0, 4], [1, 4]]

    def test_none_is_every_real_position_and_a_bool_mask_is_taken_as_is(self) -> None:
        assert torch.equal(select_queries(None, self.mask, 2, 5), self.mask)
        assert torch.equal(select_queries(None, None, 2, 5), torch.ones(2, 5, dtype=torch.bool))
        one = torch.tensor([False, False, False, False, True])
        assert select_queries(one, self.mask, 2, 5).sum().item() == 2

    def test_bad_queries_name_the_range_and_the_way_out(self) -> None:
        with pytest.raises(
            IndexError,
            match=r"query 3 is outside text 0, which has 3 real tokens \(valid: -3..2; .*shortest text",
        ):
            select_queries([3], self.mask, 2, 5)
        with pytest.raises(TypeError, match="queries must be an int"):
            select_queries(1.0, self.mask, 2, 5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ints"):
            select_queries([True], self.mask, 2, 5)
        with pytest.raises(TypeError, match="boolean mask"):
            select_queries(torch.tensor([1, 2]), self.mask, 2, 5)
        with pytest.raises(ValueError, match="selects padding"):
            select_queries(torch.ones(5, dtype=torch.bool), self.mask, 2, 5)
        with pytest.raises(ValueError, match="selects no position"):
            select_queries([], self.mask, 2, 5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_readers_get_the_mask_of_the_pass(side: str) -> None:
    model = make_tiny(attn_only=True)
    tokens, mask = _padded(ROWS, side)
    seen: dict[int, torch.Tensor | None] = {}
    reader = LayerCollector(model, None, lambda acts: seen.__setitem__(acts.layer, acts.key_mask))
    run_batches(model, tokens, reader.fwd_hooks, batch_size=2, attention_mask=mask)
    # the last batch is text 2 alone, still padded to the batch length: its rows of the mask
    assert seen[1] is not None and torch.equal(seen[1].cpu(), mask[2:])
    run_hooks(model, tokens[1:2], reader.fwd_hooks)  # text 1 fills its row: no padding, no mask
    assert seen[0] is None
    with pass_mask(mask):  # a pass of the user's own, told its mask
        model.run_with_hooks(tokens, attention_mask=mask.long(), fwd_hooks=reader.fwd_hooks)
    assert seen[0] is not None and torch.equal(seen[0].cpu(), mask)
    model.run_with_hooks(tokens, attention_mask=mask.long(), fwd_hooks=reader.fwd_hooks)
    assert seen[0] is None  # not told: a decoder's positions all count as text (never guessed)


@pytest.mark.parametrize("side", ["left", "right"])
def test_contribution_of_a_padded_batch_equals_each_text_alone(side: str) -> None:
    """The end-to-end property the analyses build on: positions are offset by the model, pads are 0."""
    model = make_tiny()
    tokens, mask = _padded(ROWS, side)
    batch = contribution_weights(model, tokens, attention_mask=mask)
    assert batch.key_mask is not None and torch.equal(batch.key_mask.cpu(), mask)
    for b, row in enumerate(ROWS):
        alone = contribution_weights(model, torch.tensor([row]))
        real = mask[b].nonzero().flatten()
        for name, t in alone.intra.items():
            got = batch.intra[name][b][..., real[:, None], real]
            torch.testing.assert_close(got, t[0], rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
            pads = batch.intra[name][b][..., ~mask[b], :]
            assert bool((pads == 0).all()) and bool((batch.intra[name][b][..., ~mask[b]] == 0).all())
        for name, t in alone.inter.items():
            got = batch.inter[name][b][..., real[:, None], real]
            torch.testing.assert_close(got, t[0], rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_cache_of_a_padded_pass_is_read_with_its_mask(side: str) -> None:
    model = make_tiny(attn_only=True)
    tokens, mask = _padded(ROWS, side)
    _, cache = model.run_with_cache(tokens, attention_mask=mask.long())
    live = contribution_weights(model, tokens, attention_mask=mask, intra=["contribution"], inter=[])
    cached = contribution_weights(
        model, tokens, cache=cache, attention_mask=mask, intra=["contribution"], inter=[]
    )
    torch.testing.assert_close(cached.intra["contribution"], live.intra["contribution"], equal_nan=True)


def test_collect_passes_each_batch_its_rows_of_the_mask() -> None:
    model = make_tiny(attn_only=True)
    tokens, mask = _padded(ROWS, "left")
    masks: list[torch.Tensor | None] = []

    class Masks(ContributionCollector):
        def on_layer(self, acts):  # type: ignore[no-untyped-def]
            masks.append(None if acts.key_mask is None else acts.key_mask.cpu())
            super().on_layer(acts)

    collect(
        model,
        tokens,
        Masks(model, layers=[0], intra=["attention"], inter=[]),
        batch_size=1,
        attention_mask=mask,
    )
    assert (
        [None if m is None else m.tolist() for m in masks]
        == [
            mask[0:1].tolist(),
            None,  # text 1 fills its row
            mask[2:3].tolist(),
        ]
    )


def test_an_encoders_left_padded_batch_is_right_aligned_and_equals_each_text_alone() -> None:
    """An encoder's positions are absolute (and not shifted by a left-padding mask): its batch is right-aligned
    before the pass, so each text is read at its own positions."""
    model = make_tiny(attention_dir="bidirectional", attn_only=True)
    tokens, mask = _padded(ROWS, "left")
    aligned, amask = to_batch(model, tokens, attention_mask=mask, encoders=True)
    assert amask is not None and bool(amask[:, 0].all())
    for b, row in enumerate(ROWS):
        assert aligned[b, : len(row)].tolist() == row
    batch = contribution_weights(model, tokens, attention_mask=mask, intra=["contribution"], inter=[])
    for b, row in enumerate(ROWS):
        alone = contribution_weights(model, torch.tensor([row]), intra=["contribution"], inter=[])
        n = len(row)
        torch.testing.assert_close(
            batch.intra["contribution"][b][..., :n, :n], alone.intra["contribution"][0], rtol=1e-5, atol=1e-5
        )
    # a cache keeps its activations where they were: its mask is not moved
    assert torch.equal(to_batch(model, tokens, attention_mask=mask, encoders=True, align=False)[1], mask)
