"""Next-token loss and multiple-choice scoring (mechgeom.analyses.scoring) against brute-force references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny, needs_hooked, random_tokens

import mechgeom.analyses.scoring as evaluation
from mechgeom.analyses.scoring import (
    EncodedItem,
    encode_choices,
    perplexity,
    predicted_correct,
    score_choices,
    target_logprob,
    task_accuracy,
    text_nll,
    token_nll,
)
from mechgeom.data import TaskItem
from mechgeom.hooks import has_hooks, head_ablation_hooks

VOCAB = 50


def _fake_encode(_model, text, *, prepend_bos):
    """A character tokenizer (the tiny models have none): one id per character, BOS = 0 when asked."""
    return ([0] if prepend_bos else []) + [1 + ord(ch) % (VOCAB - 1) for ch in text]


@pytest.fixture
def char_tokens(monkeypatch):
    monkeypatch.setattr(evaluation, "_encode", _fake_encode)


def _bruteforce_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``-log softmax(logits[b, i])[tokens[b, i + 1]]`` with loops, float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    batch, pos = tokens.shape
    out = torch.zeros(batch, pos - 1, dtype=torch.float64)
    for b in range(batch):
        for i in range(pos - 1):
            out[b, i] = -logp[b, i, tokens[b, i + 1]]
    return out


# --------------------------------------------------------------------------- next-token loss


@pytest.mark.parametrize("n_kv", [None, 2])
def test_token_nll_equals_log_softmax_bruteforce(n_kv):
    model = make_tiny(n_kv=n_kv, seed=3)
    toks = random_tokens(3, 9, seed=1)
    got = token_nll(model, toks)
    assert got.shape == (3, 8) and got.dtype == torch.float32 and got.device.type == "cpu"
    with torch.no_grad():
        want = _bruteforce_nll(model(toks), toks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    hooks = head_ablation_hooks(model, [(0, 1), (1, 2)])
    ablated = token_nll(model, toks, hooks)
    with torch.no_grad():
        want_ablated = _bruteforce_nll(model.run_with_hooks(toks, fwd_hooks=hooks), toks)
    torch.testing.assert_close(ablated.double(), want_ablated, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, ablated)
    assert not has_hooks(model)
    # text_nll and perplexity are the mean of token_nll over positions (and texts)
    torch.testing.assert_close(text_nll(model, toks, hooks, batch_size=2), ablated.mean(dim=-1))
    assert perplexity(model, toks) == pytest.approx(float(torch.exp(want.mean())), rel=1e-5)


@pytest.mark.parametrize(
    ("norm", "cap"),
    [("LN", 0.0), ("LN", 3.0), ("RMS", 0.0), (None, 0.0)],
    ids=["ln", "ln-softcap", "rms", "none"],
)
def test_target_logprob_equals_loop_over_scored_positions(norm, cap):
    """The summed log-likelihood of the scored predictions, looped in float64 from the model's own logits;
    some positions are scored by no row, so a HookedTransformer unembeds only the rest."""
    model = make_tiny(normalization_type=norm, seed=4)
    model.cfg.output_logits_soft_cap = cap
    toks = random_tokens(3, 12, seed=2)
    targets = torch.zeros(3, 11, dtype=torch.bool)
    targets[0, 7:10] = True
    targets[1, 2] = True
    targets[2, [5, 10]] = True  # positions 0, 1, 3, 4, 6 are scored by no row
    hooks = head_ablation_hooks(model, [(0, 1)])
    for fwd_hooks in ([], hooks):
        got = target_logprob(model, toks, targets, fwd_hooks)
        with torch.no_grad():
            logits = model.run_with_hooks(toks, fwd_hooks=fwd_hooks)
        nll = _bruteforce_nll(logits, toks)
        want = torch.tensor([-sum(nll[b, t] for t in range(11) if targets[b, t]) for b in range(3)])
        assert got.shape == (3,) and got.device.type == "cpu"
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            got, -(token_nll(model, toks, fwd_hooks) * targets).sum(-1), atol=1e-5, rtol=1e-5
        )
        assert not has_hooks(model)
    assert not torch.allclose(
        target_logprob(model, toks, targets), target_logprob(model, toks, targets, hooks)
    )
    every = torch.ones(3, 11, dtype=torch.bool)  # every position scored: the plain path
    torch.testing.assert_close(target_logprob(model, toks, every), -token_nll(model, toks).sum(-1))


def test_token_nll_removes_hooks_on_error():
    model = make_tiny()

    def boom(tensor, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        token_nll(model, random_tokens(2, 5), [("blocks.0.attn.hook_z", boom)])
    assert not has_hooks(model)


@needs_hooked  # start_at_layer from a residual stream is the HookedTransformer path of the sweep
def test_token_nll_from_a_residual_stream():
    model = make_tiny(n_layers=3, seed=2)
    toks = random_tokens(2, 7, seed=5)
    with torch.no_grad():
        resid = model(toks, stop_at_layer=1)
    hooks = head_ablation_hooks(model, [(2, 0)])
    got = token_nll(model, resid, hooks, start_at_layer=1, tokens=toks)
    torch.testing.assert_close(got, token_nll(model, toks, hooks), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- multiple choice: encoding


def test_encode_choices_bos_and_left_truncation(char_tokens, monkeypatch):
    model = make_tiny(n_ctx=16)
    items = [
        TaskItem("t", "abcdefghijklmnopqrstuvwxyz", (" yes", " no"), 1),
        TaskItem("t", "hi", ("x", "yz"), 0),
    ]
    for bos in (True, False):
        monkeypatch.setattr(model.cfg, "default_prepend_bos", bos)
        for max_len in (None, 10):
            limit = 16 if max_len is None else max_len
            enc = encode_choices(model, items, max_len)
            assert all(isinstance(e, EncodedItem) for e in enc)
            for item, e in zip(items, enc, strict=True):
                choices = [_fake_encode(model, c, prepend_bos=False) for c in item.choices]
                assert e.choices == choices  # choices never get a BOS
                full = _fake_encode(model, item.prompt, prepend_bos=bos)
                keep = limit - max(len(c) for c in choices)
                assert e.prompt == full[len(full) - keep :] if len(full) > keep else e.prompt == full
                assert all(len(e.prompt) + len(c) <= limit for c in e.choices)
            # the long prompt is cut from the left (its last tokens stay, the BOS goes)
            assert (
                len(enc[0].prompt) == limit - 4
                and enc[0].prompt[-1] == _fake_encode(model, "z", prepend_bos=False)[0]
            )
            assert enc[1].prompt == _fake_encode(model, "hi", prepend_bos=bos)  # a short prompt is kept whole


def test_encode_choices_errors(char_tokens, monkeypatch):
    model = make_tiny(n_ctx=16)
    with pytest.raises(ValueError, match="item 0 has answer 2 but 2 choices"):
        encode_choices(model, [TaskItem("t", "p", ("a", "b"), 2)])
    with pytest.raises(ValueError, match="item 1 has answer -1 but 2 choices"):
        encode_choices(model, [TaskItem("t", "p", ("a", "b"), 0), TaskItem("t", "p", ("a", "b"), -1)])
    with pytest.raises(ValueError, match="has answer 0 but 0 choices"):
        encode_choices(model, [TaskItem("t", "p", (), 0)])
    with pytest.raises(ValueError, match=r"item 0 choice 1 \(''\) has no tokens"):
        encode_choices(model, [TaskItem("t", "p", ("a", ""), 0)])
    with pytest.raises(ValueError, match="item 0 choice 0 is 5 tokens, not shorter than max_len=5"):
        encode_choices(model, [TaskItem("t", "p", ("abcde", "b"), 0)], max_len=5)
    with pytest.raises(ValueError, match="not shorter than max_len=16"):
        encode_choices(model, [TaskItem("t", "p", ("x" * 16, "b"), 0)])
    assert encode_choices(model, [TaskItem("t", "p", ("abcd", "b"), 0)], max_len=5)[0].prompt == [
        1 + ord("p") % 49
    ]
    monkeypatch.setattr(model.cfg, "default_prepend_bos", False)
    with pytest.raises(ValueError, match="item 0 has an empty prompt"):
        encode_choices(model, [TaskItem("t", "", ("a", "b"), 0)])
    monkeypatch.setattr(model.cfg, "default_prepend_bos", True)
    assert encode_choices(model, [TaskItem("t", "", ("a", "b"), 0)])[0].prompt == [0]  # the BOS is a context


# --------------------------------------------------------------------------- multiple choice: scores


def test_score_choices_equals_unbatched_bruteforce():
    model = make_tiny(n_layers=2, seed=6, d_vocab=50)
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, 50, (n,), generator=g).tolist()

    encoded = [
        (ids(5), [ids(2), ids(4)]),
        (ids(9), [ids(1), ids(3)]),
        (ids(3), [ids(6), ids(2)]),
        (ids(7), [ids(1), ids(1)]),  # single-token choices: scored from one forward of the prompt
        (ids(4), [ids(1), ids(1)]),
    ]
    scores = score_choices(model, encoded, batch_size=4)  # padding inside batches
    hooks = head_ablation_hooks(model, [(1, 1)])
    scores_ablated = score_choices(model, encoded, hooks, batch_size=3)
    for fwd, got in (([], scores), (hooks, scores_ablated)):
        for i, (prompt, choices) in enumerate(encoded):
            for c, choice in enumerate(choices):
                seq = torch.tensor([prompt + choice])
                with torch.no_grad(), model.hooks(fwd_hooks=fwd):
                    logp = torch.log_softmax(model(seq)[0].double(), dim=-1)
                ref = sum(float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(choice))
                assert got[i, c].item() == pytest.approx(ref, rel=1e-6, abs=1e-6)
    assert not torch.allclose(scores, scores_ablated)
    items = [TaskItem("t", "p", ("a", "b"), answer=int(a)) for a in scores.argmax(1).tolist()]
    assert task_accuracy(model, items, encoded=encoded) == 1.0
    flipped = [TaskItem("t", "p", ("a", "b"), answer=1 - it.answer) for it in items]
    assert task_accuracy(model, flipped, encoded=encoded) == 0.0
    # EncodedItem is the same tuple
    again = score_choices(model, [EncodedItem(p, c) for p, c in encoded], batch_size=4)
    torch.testing.assert_close(again, scores, atol=0, rtol=0)
    assert not has_hooks(model)


def test_score_choices_of_task_items_loop_bruteforce(char_tokens):
    """Task items go through encode_choices; each prompt+choice sequence scored alone gives the same numbers."""
    model = make_tiny(n_layers=2, seed=9, n_ctx=24)
    items = [
        TaskItem("boolq", "the sky is blue. is it?", (" no", " yes"), 1),
        TaskItem("mmlu", "pick one:", (" A", " B"), 0),
        TaskItem("winogrande", "she gave him", (" the cat back", " a book"), 0),
        TaskItem("winogrande", "a much longer prompt that must be cut", (" it", " them all"), 1),
    ]
    scores = score_choices(model, items, batch_size=3, max_len=20)
    for i, e in enumerate(encode_choices(model, items, 20)):
        for c, choice in enumerate(e.choices):
            seq = torch.tensor([e.prompt + choice])
            with torch.no_grad():
                logp = torch.log_softmax(model(seq)[0].double(), dim=-1)
            ref = sum(float(logp[len(e.prompt) - 1 + t, tok]) for t, tok in enumerate(choice))
            assert scores[i, c].item() == pytest.approx(ref, rel=1e-6, abs=1e-6)
    correct = [float(int(np.argmax(scores[i].numpy())) == it.answer) for i, it in enumerate(items)]
    assert task_accuracy(model, items, max_len=20) == pytest.approx(np.mean(correct))
    with pytest.raises(ValueError, match="different numbers of choices"):
        score_choices(model, [*items, TaskItem("t", "x", (" a", " b", " c"), 0)])
    with pytest.raises(ValueError, match="no items"):
        score_choices(model, [])
    with pytest.raises(ValueError, match="at least one token"):
        score_choices(model, [([1, 2], [[3], []])])


def test_predicted_correct_ties_and_errors():
    # ties go to the first of the highest scores
    assert predicted_correct(torch.tensor([[1.0, 1.0], [0.0, 2.0]]), [0, 0]).tolist() == [1.0, 0.0]
    assert predicted_correct(np.array([[1.0, 1.0], [0.0, 2.0]]), [1, 1]).tolist() == [0.0, 1.0]
    assert predicted_correct([[3.0, 3.0, 3.0]], [2]).tolist() == [0.0]
    ragged = [[0.1, 0.9], [5.0, -1.0, 5.0, 2.0], [-2.0, -1.0, -3.0]]
    got = predicted_correct(ragged, [1, 0, 1])
    assert got.dtype == np.float64 and got.tolist() == [1.0, 1.0, 1.0]
    rng = np.random.default_rng(0)
    s = rng.integers(0, 3, size=(40, 4)).astype(float)  # many ties
    answers = rng.integers(0, 4, size=40)
    loop = []
    for row, a in zip(s, answers, strict=True):
        best = 0
        for c in range(4):
            if row[c] > row[best]:
                best = c
        loop.append(float(best == a))
    assert predicted_correct(s, answers.tolist()).tolist() == loop
    with pytest.raises(ValueError, match="2 rows of scores but 1 answers"):
        predicted_correct([[1.0], [2.0]], [0])
    with pytest.raises(ValueError, match="item 0 has answer 2 but 2 scores"):
        predicted_correct([[1.0, 2.0]], [2])
