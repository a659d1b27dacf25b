"""Inputs that 0.2 read silently wrong (issue 35, "Inputs checked"): each case fails on the starting code.

- ``layers="12"`` analysed layers 1 and 2, ``layers=True`` layer 1; floats failed deep inside;
- ``intra=[], inter=[]`` ended in a bare ``StopIteration``;
- a wrong-shaped ``attention_mask`` gave TransformerLens' ``AssertionError``;
- a reader placed before a ``hook_z`` patch in one hook list saw nothing (``modified_heads == []``);
- weight put on a key after its query, at 128 tokens or fewer, was not marked, and ``sum_j c`` was off.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_tiny, random_tokens

import mechgeom
from mechgeom import ContributionCollector, contribution_weights
from mechgeom.hooks import has_hooks, resolve_heads, resolve_layers


@pytest.mark.parametrize("bad", ["12", True, 1.0, [0, 1.0], [True], torch.tensor([0.0])])
def test_layers_and_heads_take_ints_only(bad: object) -> None:
    model = make_tiny(n_layers=3, seed=1)
    with pytest.raises(TypeError, match="layers"):
        resolve_layers(model, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="heads"):
        resolve_heads(model, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"layers=12 or layers=\[1, 2\]|must hold ints|integer indices"):
        contribution_weights(model, random_tokens(1, 4), layers=bad)  # type: ignore[arg-type]
    assert not has_hooks(model)


def test_integer_layers_in_every_form_still_work() -> None:
    model = make_tiny(n_layers=3, seed=1)
    for given, want in (
        (2, [2]),
        ([2, 0], [2, 0]),
        ((1,), [1]),
        (torch.tensor([1, 2]), [1, 2]),
        (torch.tensor(1), [1]),
    ):
        assert resolve_layers(model, given) == want


def test_no_metric_at_all_is_refused_with_the_choices() -> None:
    model = make_tiny(n_layers=1, seed=1)
    with pytest.raises(ValueError, match=r"nothing to compute.*intra=\['contribution'\]"):
        ContributionCollector(model, intra=[], inter=[])
    res = contribution_weights(
        model, random_tokens(1, 4), intra=[], inter=["contribution"]
    )  # one kind is enough
    assert res.shape == (1, 0, 4) and set(res.inter) == {"contribution"}


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (torch.ones(2, 5), r"shape \(2, 5\), but the tokens are \(2, 6\)"),
        (torch.ones(6), r"shape \(6,\)"),
        (torch.full((2, 6), 2), "only 0 and 1"),
        ([[1] * 6] * 2, "must be a tensor"),
    ],
)
def test_a_wrong_attention_mask_says_what_to_pass(mask: object, match: str) -> None:
    model = make_tiny(n_layers=1, seed=1)
    with pytest.raises((ValueError, TypeError), match=match):
        contribution_weights(model, random_tokens(2, 6), attention_mask=mask)  # type: ignore[arg-type]
    assert not has_hooks(model)


def test_a_reader_before_a_z_patch_warns_and_the_right_order_marks_it() -> None:
    model = make_tiny(n_layers=2, seed=3)
    tokens = random_tokens(2, 6, seed=2)
    zero = ("blocks.1.attn.hook_z", lambda z, hook: z * 0)
    late = ContributionCollector(model, [1])
    with pytest.warns(
        UserWarning, match=r"after mechgeom's reader on blocks\.1\.attn\.hook_z.*before the readers"
    ):
        model.run_with_hooks(tokens, fwd_hooks=[*late.fwd_hooks, zero])
    first = ContributionCollector(model, [1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # interventions first: nothing to warn about
        model.run_with_hooks(tokens, fwd_hooks=[zero, *first.fwd_hooks])
    assert first.result(tokens).modified_heads == [(1, h) for h in range(model.cfg.n_heads)]
    shared = ContributionCollector(model, [1])  # two mechgeom readers on one point: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mechgeom.collect(model, tokens, [shared, mechgeom.SinkCollector(model, [1])], extra_hooks=[zero])
    assert not has_hooks(model)


def test_weight_after_the_query_is_marked_at_every_length() -> None:
    model = make_tiny(n_layers=2, seed=5)
    tokens = random_tokens(1, 6, seed=3)

    def peek(pattern, hook):  # query 0 of head 2 puts half its weight on key 1
        pattern = pattern.clone()
        pattern[:, 2, 0, :2] = 0.5
        return pattern

    res = contribution_weights(model, tokens, layers=[1], extra_hooks=[("blocks.1.attn.hook_pattern", peek)])
    marked = res.modified[0, 0]  # [head, query]
    assert marked[2, 0] and int(marked.sum()) == 1
    c = res.intra["contribution"][0, 0]
    assert torch.isnan(c[2, 0, :1]).all()  # no per-source terms for the modified row
    total = res.inter["contribution"][0, 0].nansum(-1) + res.modified_share[0, 0].sum(0)
    torch.testing.assert_close(total, torch.ones(6))  # sum_j c[i,j] + the modified heads' shares = 1
