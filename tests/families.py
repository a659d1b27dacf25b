"""The papers' model families as tiny seeded random models built offline from hand-written configs.

:func:`build` gives, for a family of :data:`FAMILIES`, a ``HookedTransformer`` on TransformerLens 3.x
(its :class:`HookedTransformerConfig` set by hand to the family's features) and, on 4.x, a
``TransformerBridge`` in compatibility mode around a randomly initialised Hugging Face model made from the
family's ``transformers`` config class (``AutoModelForCausalLM.from_config``; no hub, a word-level tokenizer
built in memory). Every model has 2 layers, ``d_model`` 32, 4 heads of ``d_head`` 8, ``n_ctx`` 32 and a
vocabulary of 50. Where a family cannot be built on the installed line, :func:`build` raises
:class:`FamilyUnavailable` with the reason (the tests skip with it).

The weights are redrawn from one seed (TransformerLens and Hugging Face initialise biases to 0 and draw
attention weights so small that every pattern is nearly uniform): every bias the family has is nonzero,
``W_Q``/``W_K`` are large enough for peaky patterns, and norm weights are ``1 + noise``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from conftest import boot_hf_bridge, tiny_word_tokenizer

D_MODEL, N_HEADS, D_HEAD, N_LAYERS, N_CTX, D_VOCAB, D_MLP = 32, 4, 8, 2, 32, 50, 64
#: The sliding window of the local layers (keys ``i - WINDOW < j <= i``), short enough to matter at 12 tokens.
WINDOW = 4
BOS = 1


class FamilyUnavailable(Exception):
    """The family cannot be built on the installed TransformerLens line; the message says why."""


@dataclass(frozen=True)
class Family:
    """What a test needs to know of a family beside the model.

    Attributes:
        name: the family's key in :data:`FAMILIES`.
        features: the features the tiny model reproduces, in words.
        local_layers: layers whose attention is a sliding window of :data:`WINDOW` keys.
        biases: ``"all"`` (every linear map and norm has one), ``"qkv"`` (queries, keys and values only)
            or ``"none"``.
        n_kv: key/value heads (``N_HEADS`` for full multi-head attention).
    """

    name: str
    features: str
    local_layers: tuple[int, ...] = ()
    biases: str = "none"
    n_kv: int = N_HEADS
    hooked: dict[str, Any] = field(default_factory=dict, repr=False)


_ROTARY = dict(positional_embedding_type="rotary", normalization_type="RMS", final_rms=True, gated_mlp=True)
_LLAMA = dict(_ROTARY, act_fn="silu", original_architecture="LlamaForCausalLM")
_LOCAL = dict(use_local_attn=True, window_size=WINDOW)
_GEMMA = dict(
    _ROTARY,
    **_LOCAL,
    act_fn="gelu_pytorch_tanh",
    n_key_value_heads=2,
    attn_types=["local", "global"],
    use_normalization_before_and_after=True,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "gpt2",
            "LayerNorm, biases, learned positions",
            biases="all",
            hooked=dict(
                normalization_type="LN",
                positional_embedding_type="standard",
                act_fn="gelu_new",
                original_architecture="GPT2LMHeadModel",
            ),
        ),
        Family(
            "pythia",
            "parallel attention and MLP, partial rotary (a quarter of d_head), biases",
            biases="all",
            hooked=dict(
                normalization_type="LN",
                positional_embedding_type="rotary",
                rotary_dim=D_HEAD // 4,
                parallel_attn_mlp=True,
                act_fn="gelu",
                original_architecture="GPTNeoXForCausalLM",
            ),
        ),
        Family("llama2", "RMSNorm, rotary, gated MLP, full multi-head attention", hooked=dict(_LLAMA)),
        Family(
            "llama3",
            "as LLaMA-2 with grouped-query attention (2 KV heads)",
            n_kv=2,
            hooked=dict(_LLAMA, n_key_value_heads=2, rotary_base=500000),
        ),
        Family(
            "mistral",
            f"GQA, every layer a sliding window of {WINDOW} keys",
            local_layers=(0, 1),
            n_kv=2,
            hooked=dict(
                _LLAMA,
                **_LOCAL,
                n_key_value_heads=2,
                attn_types=["local", "local"],
                original_architecture="MistralForCausalLM",
            ),
        ),
        Family(
            "qwen2",
            "GQA with biases on q, k and v",
            biases="qkv",
            n_kv=2,
            hooked=dict(
                _ROTARY, act_fn="silu", n_key_value_heads=2, original_architecture="Qwen2ForCausalLM"
            ),
        ),
        Family(
            "qwen3",
            "GQA with RMSNorm on queries and keys (QK-norm)",
            n_kv=2,
            hooked=dict(
                _ROTARY,
                act_fn="silu",
                n_key_value_heads=2,
                use_qk_norm=True,
                original_architecture="Qwen3ForCausalLM",
            ),
        ),
        Family(
            "gemma2",
            "local/global layers, attention-score and logit soft-capping, norms before and after",
            local_layers=(0,),
            n_kv=2,
            hooked=dict(
                _GEMMA,
                attn_scores_soft_cap=5.0,
                output_logits_soft_cap=3.0,
                original_architecture="Gemma2ForCausalLM",
            ),
        ),
        Family(
            "gemma3",
            "local/global layers, QK-norm, local rotary base, BOS prepended",
            local_layers=(0,),
            n_kv=2,
            hooked=dict(
                _GEMMA,
                use_qk_norm=True,
                rotary_base=1_000_000,
                rotary_base_local=10_000,
                original_architecture="Gemma3ForCausalLM",
            ),
        ),
    )
}


def tokens(family: str, batch: int = 2, pos: int = 12, seed: int = 0) -> torch.Tensor:
    """Seeded random ids ``[batch, pos]`` that start with BOS (every family here prepends one)."""
    ids = torch.randint(3, D_VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = BOS
    return ids


def build(family: str, seed: int = 0) -> Any:
    """The tiny random model of ``family`` on the installed TransformerLens line, in eval mode.

    Args:
        family: a key of :data:`FAMILIES`.
        seed: the seed of every weight.

    Returns:
        A ``HookedTransformer`` (TransformerLens 3.x) or a ``TransformerBridge`` (4.x).

    Raises:
        KeyError: an unknown family (the message lists them).
        FamilyUnavailable: the family cannot be built on this line; the message says why.
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; the families are {', '.join(FAMILIES)}")
    try:
        from transformer_lens import HookedTransformer  # noqa: F401  (TransformerLens 3.x only)
    except ImportError:
        return _build_bridge(FAMILIES[family], seed)
    return _build_hooked(FAMILIES[family], seed)


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn anew from ``seed``: biases ``N(0, 0.3^2)``, norm weights (the other vectors)
    ``1 + N(0, 0.1^2)``, matrices ``N(0, 1/fan_in)`` (query and key weights twice that scale, for
    peaky patterns)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("b", "bias") or leaf.lstrip("_").startswith("b_"):
                p.copy_(0.3 * noise)
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * noise)
            else:
                fan_in = p.shape[-2] if leaf.lstrip("_").startswith("W_") else p.shape[-1]
                peaky = any(k in name for k in ("W_Q", "W_K", "q_proj", "k_proj", "c_attn", "query_key"))
                p.copy_(noise * (2.0 if peaky else 1.0) / fan_in**0.5)


def _build_hooked(fam: Family, seed: int) -> Any:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=N_LAYERS,
        d_model=D_MODEL,
        n_ctx=N_CTX,
        d_head=D_HEAD,
        n_heads=N_HEADS,
        d_mlp=D_MLP,
        d_vocab=D_VOCAB,
        seed=seed,
        dtype=torch.float32,
        device="cpu",
        default_prepend_bos=True,
        **fam.hooked,
    )
    model = HookedTransformer(cfg, tokenizer=_tokenizer(), move_to_device=False)
    _redraw(model, seed)
    keep = {"all": None, "qkv": ("b_Q", "b_K", "b_V", "_b_K", "_b_V"), "none": ()}[fam.biases]
    if keep is not None:  # TransformerLens has every bias; those the family lacks stay 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf.lstrip("_").startswith("b_") and leaf not in keep:
                    p.zero_()
    # as TransformerLens 3.x loads a checkpoint (from_pretrained folds b_V into b_O; compatibility mode does on
    # 4.x): the references here read hook_v as it is. The unfolded models' convention (docs/definitions.md
    # §1.3) is tested on every analysis by tests/unit/test_value_bias_unit.py.
    model.load_state_dict(model.fold_value_biases(model.state_dict()))
    return model.eval()


def _tokenizer() -> Any:
    """The tests' word-level tokenizer of ``t0`` ... ``t49`` (``t1`` BOS, ``t2`` EOS, ``t0`` padding)."""
    return tiny_word_tokenizer(bos_token="t1", eos_token="t2", add_bos_token=True)


def hf_config(family: str) -> Any:
    """The family's ``transformers`` config with the tiny sizes (eager attention, so hooks see patterns)."""
    import transformers as tr

    common = dict(
        vocab_size=D_VOCAB,
        hidden_size=D_MODEL,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        head_dim=D_HEAD,
        intermediate_size=D_MLP,
        max_position_embeddings=N_CTX,
        bos_token_id=BOS,
        eos_token_id=2,
        pad_token_id=0,
    )
    gqa = dict(common, num_key_value_heads=2)
    local = dict(gqa, sliding_window=WINDOW)
    configs = {
        "gpt2": lambda: tr.GPT2Config(
            vocab_size=D_VOCAB,
            n_embd=D_MODEL,
            n_layer=N_LAYERS,
            n_head=N_HEADS,
            n_positions=N_CTX,
            n_inner=D_MLP,
            bos_token_id=BOS,
            eos_token_id=2,
        ),
        "pythia": lambda: tr.GPTNeoXConfig(
            **{k: common[k] for k in common if k != "head_dim"}, rotary_pct=0.25, use_parallel_residual=True
        ),
        "llama2": lambda: tr.LlamaConfig(**common),
        "llama3": lambda: tr.LlamaConfig(**gqa, rope_theta=500000.0),
        "mistral": lambda: tr.MistralConfig(**local),
        "qwen2": lambda: tr.Qwen2Config(**gqa),
        "qwen3": lambda: tr.Qwen3Config(**gqa),
        "gemma2": lambda: tr.Gemma2Config(**local, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3": lambda: tr.Gemma3TextConfig(**local, sliding_window_pattern=2),
    }
    cfg = configs[family]()
    cfg._attn_implementation = "eager"
    return cfg


def _build_bridge(fam: Family, seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    cfg = hf_config(fam.name)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    # the bridge picks its architecture adapter from config.architectures, which from_config leaves empty
    hf.config.architectures = [type(hf).__name__]
    _redraw(hf, seed)
    hf.eval()
    try:
        return boot_hf_bridge(hf, _tokenizer(), f"tiny-{fam.name}")
    except Exception as exc:  # pragma: no cover - depends on the installed TransformerLens
        raise FamilyUnavailable(
            f"TransformerBridge.boot_transformers cannot wrap {type(hf).__name__}: {type(exc).__name__}: {exc}"
        ) from exc
