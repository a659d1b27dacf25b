"""Sinks on a bidirectional model: sink sets named per text ("[CLS]", "[SEP]"), every query, no padding.

Tiny random encoders (``make_tiny(attention_dir="bidirectional")``, both TransformerLens lines) with a
stand-in tokenizer that knows three special tokens; every statistic is checked against loops in the test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny, random_tokens
from reference_contribution import acts_of

from mechgeom import collect
from mechgeom.analyses.sinks.encoder import encoder_sink_statistics, merge_sink_results
from mechgeom.analyses.sinks.statistics import SinkCollector, sink_statistics
from mechgeom.hooks import has_hooks, sink_positions_per_text

PAD, CLS, SEP, UNK = 0, 1, 2, 3
_IDS = {"[PAD]": PAD, "[CLS]": CLS, "[SEP]": SEP, "[UNK]": UNK}


@pytest.fixture(autouse=True)
def one_thread():
    """These tests compare a batch with each text alone at float64's tolerance. With several threads BLAS
    blocks a batch of 2 and a single text differently (4e-7 apart on float32 activations, and more in the
    logs of the factor moments), which is not what they test: pin one thread, as CI runs, and restore it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _encoder(seed: int):
    model = make_tiny(attention_dir="bidirectional", seed=seed, n_kv=2)
    model.tokenizer = SimpleNamespace(
        pad_token_id=PAD,
        unk_token_id=UNK,
        unk_token="[UNK]",
        convert_tokens_to_ids=lambda t: _IDS.get(t, UNK),
    )
    model.to_str_tokens = lambda row: [str(int(t)) for t in row]
    return model


def _texts(lengths: list[int], seed: int) -> torch.Tensor:
    """``[CLS] ... [SEP]`` texts, right-padded with ``[PAD]``; body ids 4..49."""
    body = random_tokens(len(lengths), max(lengths), seed=seed) % 46 + 4
    out = torch.full((len(lengths), max(lengths)), PAD)
    for b, n in enumerate(lengths):
        out[b, :n] = body[b, :n]
        out[b, 0], out[b, n - 1] = CLS, SEP
    return out


def _reference(model, text: torch.Tensor, sinks: list[int], layer: int) -> dict[str, torch.Tensor]:
    """Loops over one unpadded text: sink rate over every query, norm ratio and token cosine over j ∉ S."""
    _, cache = model.run_with_cache(text[None])
    alpha, v, _ = acts_of(cache, layer)
    alpha, v = alpha[0].double(), v[0].double()  # [h q k], [k kv d]
    W = model.W_O[layer].detach().double()
    H, n = alpha.shape[0], alpha.shape[-1]
    group = H // v.shape[1]
    rest = [j for j in range(n) if j not in sinks]
    rate = torch.zeros(H, dtype=torch.float64)
    ratio = torch.zeros(H, len(sinks), dtype=torch.float64)
    cos = torch.zeros(H, len(sinks), dtype=torch.float64)
    for h in range(H):
        vt = torch.stack([v[j, h // group] @ W[h] for j in range(n)])  # [k m]
        rate[h] = sum(float(alpha[h, i, s]) for i in range(n) for s in sinks) / n  # every query
        mean_norm = sum(float(vt[j].norm()) for j in rest) / len(rest)
        for si, s in enumerate(sinks):
            ratio[h, si] = float(vt[s].norm()) / mean_norm
            cos[h, si] = sum(float(torch.cosine_similarity(vt[s], vt[j], dim=0)) for j in rest) / len(rest)
    return {"sink_rate": rate, "norm_ratio_vt": ratio, "cos_sink_tokens": cos}


def test_named_sinks_resolve_per_text_and_match_loops() -> None:
    model = _encoder(80)
    lengths = [7, 5, 7, 4]
    tokens = _texts(lengths, seed=81)
    res = sink_statistics(model, tokens, sink_positions=["[CLS]", "[SEP]"], batch_size=3)
    assert not has_hooks(model)
    assert res.sink_positions == ["[CLS]", "[SEP]"]
    assert res.extras["sink_positions_per_text"] == [[0, n - 1] for n in lengths]
    assert res.sink_rate.shape[0] == 4 and res.sink_mass.shape[-1] == 7
    for b, n in enumerate(lengths):
        for li, layer in enumerate(res.layers):
            ref = _reference(model, tokens[b, :n], [0, n - 1], layer)
            for name, want in ref.items():
                torch.testing.assert_close(
                    getattr(res, name)[b, li].double(), want, atol=1e-5, rtol=1e-4, msg=name
                )
        # every query is in Q on an encoder; beyond the text's length the per-query terms are NaN
        assert not res.sink_mass[b, ..., :n].isnan().any()
        assert res.sink_mass[b, ..., n:].isnan().all()
    torch.testing.assert_close(res.tokens, tokens)
    frame = res.to_frame()
    assert set(frame["sink"]) == {"[CLS]", "[SEP]"}
    assert len(frame) == len(res.layers) * model.cfg.n_heads * 2


def test_grouped_result_equals_each_text_alone_and_positions_mix_with_names() -> None:
    model = _encoder(82)
    lengths = [6, 8, 6]
    tokens = _texts(lengths, seed=83)
    res = sink_statistics(model, tokens, sink_positions=[0, "[SEP]"], batch_size=2)
    assert res.sink_positions == [0, "[SEP]"]
    for b, n in enumerate(lengths):
        alone = sink_statistics(model, tokens[b : b + 1, :n], sink_positions=[0, n - 1])
        assert alone.sink_positions == [0, n - 1]
        for name in ("sink_rate", "sink_rate_pos", "norm_ratio_vt", "cos_sink_tokens", "cos_sink_mean"):
            torch.testing.assert_close(getattr(res, name)[b], getattr(alone, name)[0], msg=name)
        torch.testing.assert_close(res.sq_sink[b, ..., :n], alone.sq_sink[0], equal_nan=True)
    # the factor moments add over the groups: counts are every (query, key) entry with finite logs
    tail_n = res.factor_sums[..., 1, 0].sum()
    assert tail_n > 0
    total = sum(
        sink_statistics(model, tokens[b : b + 1, :n], sink_positions=[0, n - 1]).factor_sums
        for b, n in enumerate(lengths)
    )
    # the counts exactly; the sums are float64 accumulations of float32 logs, whose last bits depend on how BLAS
    # blocks a batch of 2 versus 1 text (CPU-dependent: bitwise equal on one machine, 7e-7 apart on another), so
    # they agree to float32's precision, not float64's
    assert torch.equal(res.factor_sums[..., 0], total[..., 0])
    torch.testing.assert_close(res.factor_sums, total, rtol=1e-5, atol=1e-5)


def test_encoder_tail_group_counts_keys_after_the_query() -> None:
    model = _encoder(84)
    tokens = _texts([6], seed=85)
    res = sink_statistics(model, tokens, sink_positions=["[CLS]"])
    n_heads = model.cfg.n_heads
    # all 6 queries x 5 non-sink keys per head (a decoder would count only keys j <= i, i > 0: 15)
    assert int(res.factor_sums[0, :, 1, 0].sum()) == 6 * 5 * n_heads
    assert int(res.factor_sums[0, :, 0, 0].sum()) == 6 * 1 * n_heads


def test_sink_name_errors_are_clear() -> None:
    model = _encoder(86)
    tokens = _texts([5, 5], seed=87)
    tokens[1, 2] = SEP  # two [SEP] in text 1
    with pytest.raises(ValueError, match="occurs 2 times in text 1"):
        sink_statistics(model, tokens, sink_positions=["[CLS]", "[SEP]"])
    with pytest.raises(ValueError, match="not a token"):
        sink_statistics(model, _texts([5], seed=88), sink_positions=["[MASK]"])
    assert not has_hooks(model)
    plain = make_tiny(attention_dir="bidirectional", seed=1)
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        sink_positions_per_text(plain, tokens, ["[CLS]"])


def test_a_padded_batch_in_the_bare_collector_is_each_text_alone() -> None:
    """The collector once refused a padded encoder batch; it now reads each text on its real tokens (issue
    35), so its numbers are those of the texts run alone, padding never a query, a source or a sink."""
    model = _encoder(89)
    tokens = _texts([6, 4], seed=90)
    padded = collect(model, tokens, SinkCollector(model))
    assert not has_hooks(model)
    for b, n in enumerate([6, 4]):
        alone = collect(model, tokens[b : b + 1, :n], SinkCollector(model))
        for name in ("sink_rate", "norm_ratio_vt", "cos_sink_tokens", "cos_sink_mean"):
            torch.testing.assert_close(
                getattr(padded, name)[b], getattr(alone, name)[0], rtol=1e-5, atol=1e-6
            )
        torch.testing.assert_close(padded.sink_mass[b, ..., :n], alone.sink_mass[0], rtol=1e-5, atol=1e-6)
        assert bool(padded.sink_mass[b, ..., n:].isnan().all())


def test_merge_checks_its_parts() -> None:
    model = _encoder(91)
    a = encoder_sink_statistics(model, _texts([5], seed=92), sink_positions=["[CLS]"])
    with pytest.raises(ValueError, match=r"cover 0\.\.1 once each"):
        merge_sink_results([([0], a), ([0], a)], n_texts=2)
    with pytest.raises(ValueError, match="no results"):
        merge_sink_results([], n_texts=0)


def test_corpus_windows_of_an_encoder_are_cls_text_sep() -> None:
    from mechgeom.data import corpus_texts, load_corpus

    def tok(text, add_special_tokens=False):
        assert add_special_tokens is False
        return {"input_ids": [4 + ord(c) % 40 for c in text]}

    tok.cls_token_id, tok.sep_token_id, tok.bos_token_id = CLS, SEP, None
    enc = SimpleNamespace(tokenizer=tok, cfg=SimpleNamespace(n_ctx=64, attention_dir="bidirectional"))
    windows = load_corpus("wikitext2", enc, n_texts=3, seq_len=16, seed=0)
    assert windows.shape == (3, 16)
    assert (windows[:, 0] == CLS).all() and (windows[:, -1] == SEP).all()
    assert ((windows[:, 1:-1] != CLS) & (windows[:, 1:-1] != SEP)).all()
    # the body is each document's first 14 tokens, as a decoder's window is its first 16
    docs = {
        tuple(tok(d)["input_ids"][:14]) for d in corpus_texts("wikitext2") if len(tok(d)["input_ids"]) >= 14
    }
    assert all(tuple(w[1:-1].tolist()) in docs for w in windows)
    with pytest.raises(ValueError, match="no room for text"):
        load_corpus("wikitext2", enc, n_texts=1, seq_len=2)


def test_from_cache_on_an_encoder_equals_the_run() -> None:
    from mechgeom.analyses.sinks.statistics import sink_statistics_from_cache

    model = _encoder(93)
    tokens = _texts([6, 6], seed=94)
    _, cache = model.run_with_cache(tokens)
    cached = sink_statistics_from_cache(model, cache, tokens=tokens, sink_positions=[0, 5])
    run = sink_statistics(model, tokens, sink_positions=["[CLS]", "[SEP]"])
    for name in ("sink_rate", "norm_ratio_vt", "cos_sink_tokens", "sq_sink"):
        torch.testing.assert_close(getattr(cached, name), getattr(run, name), msg=name)
    assert torch.equal(cached.tokens, tokens)
