"""The backend adapter (:mod:`mechgeom.models.adapter`) and the rule that keeps backend knowledge in it.

Each answer of the adapter is checked against what the model itself does, on tiny random models of both
TransformerLens lines: a ``HookedTransformer`` (a decoder, and a bidirectional one) and a ``HookedEncoder`` on
3.x, a ``TransformerBridge.boot_native`` decoder and encoder on both. The structure test reads the source of
every mechgeom module outside ``mechgeom/models/`` and fails on a class-name test, ``is_bridge``, an
``isinstance`` against a TransformerLens model class or a TransformerLens version check.
"""

from __future__ import annotations

import ast
import gc
import warnings
import weakref
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED, make_hooked_encoder, make_tiny, needs_hooked, random_tokens

import mechgeom
from mechgeom.models import TL_VERSION, ModelAdapter, is_bridge, is_encoder
from mechgeom.models.adapter import adapter

TL4 = int(TL_VERSION.split(".")[0]) >= 4


def _bridge(attention_dir: str = "causal", seed: int = 0) -> Any:
    """A ``TransformerBridge.boot_native`` model on either line (``make_tiny`` gives one on 3.x only for an
    encoder)."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        n_layers=2, d_model=16, n_ctx=16, d_head=4, n_heads=4, d_mlp=32, act_fn="gelu", d_vocab=50,
        normalization_type="LN", attention_dir=attention_dir, seed=seed,
    )  # fmt: skip
    return TransformerBridge.boot_native(cfg).eval()


def _hooked(**kw: Any) -> Any:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = dict(
        n_layers=2, d_model=16, n_ctx=16, d_head=4, n_heads=4, d_mlp=32, act_fn="gelu", d_vocab=50,
        normalization_type="LN", seed=0,
    )  # fmt: skip
    return HookedTransformer(HookedTransformerConfig(**{**cfg, **kw})).eval()


# Each backend's name, constructor and expected kind, encoder flag and answer to "do hook_pattern edits
# take effect" (TransformerLens 3.x's bridges run the attention in the HF module and discard them).
BACKENDS = {
    "hooked": (lambda: make_tiny(), "hooked", False, True),
    "hooked_bidirectional": (lambda: _hooked(attention_dir="bidirectional"), "hooked", True, True),
    "hooked_encoder": (make_hooked_encoder, "hooked_encoder", True, True),
    "bridge": (_bridge, "bridge", False, TL4),
    "bridge_encoder": (lambda: make_tiny(attention_dir="bidirectional"), "bridge", True, TL4),
}
HOOKED_ONLY = {"hooked", "hooked_bidirectional", "hooked_encoder"}


def _backend(name: str) -> tuple[Any, str, bool, bool]:
    build, kind, encoder, pattern = BACKENDS[name]
    if name in HOOKED_ONLY and not HAS_HOOKED:
        pytest.skip("HookedTransformer and HookedEncoder need TransformerLens 3.x")
    return build(), kind, encoder, pattern


def _logits(model: Any, tokens: torch.Tensor, hooks: Sequence[tuple[str, Any]] = ()) -> torch.Tensor:
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks), reset_hooks_end=True):
        return model(tokens)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_the_adapter_names_the_backend(name: str) -> None:
    model, kind, encoder, _ = _backend(name)
    a = adapter(model)
    assert isinstance(a, ModelAdapter) and a.model is model
    assert a.kind == kind and a.is_bridge == (kind == "bridge") == is_bridge(model)
    assert a.is_encoder == encoder == is_encoder(model)
    assert a.device == torch.device("cpu") and a.dtype == torch.float32
    assert type(model).__name__ in a.name and TL_VERSION in a.name
    assert adapter(model) is a  # one adapter per model
    assert adapter(_backend(name)[0]) is not a


@pytest.mark.parametrize("name", list(BACKENDS))
def test_pattern_edits_take_effect_as_the_forward_shows(name: str) -> None:
    """The probe's answer against the model's own output: zeroing layer 0's pattern changes the logits
    exactly when the adapter says the edit takes effect; zeroing ``hook_z`` always does."""
    model, _, _, expected = _backend(name)
    a = adapter(model)
    tokens = random_tokens(batch=1, pos=5, seed=3)
    zero = [("blocks.0.attn.hook_pattern", lambda x, hook: torch.zeros_like(x))]
    with warnings.catch_warnings():  # a bridge may warn that it discards the edit
        warnings.simplefilter("ignore")
        changed = not torch.allclose(_logits(model, tokens), _logits(model, tokens, zero))
    assert a.pattern_edits_take_effect(0) is expected is changed
    assert a._pattern_edits == {0: expected}  # cached: one probe per layer
    z_zero = [("blocks.1.attn.hook_z", lambda x, hook: torch.zeros_like(x))]
    assert a.edits_reach_output(1, z_zero, tokens=tokens)
    assert not a.edits_reach_output(1, [("blocks.1.attn.hook_z", lambda x, hook: x)], tokens=tokens)
    assert not model.hook_dict["blocks.0.attn.hook_pattern"].fwd_hooks  # no hook left attached


def test_the_error_for_ignored_edits_names_the_backend_and_the_hook_points() -> None:
    a = adapter(_bridge())
    err = a.ignored_edits_error(3, ("hook_pattern", "hook_z"), "source masking")
    assert isinstance(err, RuntimeError)
    msg = str(err)
    assert msg.startswith(f"TransformerBridge (TransformerLens {TL_VERSION}) ignores edits to ")
    assert "blocks.3.attn.hook_pattern and hook_z" in msg and "source masking would change nothing" in msg
    assert ("backend='hooked'" in msg) == (not TL4)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_forward_kwargs_pass_stop_at_layer_where_the_forward_takes_it(name: str) -> None:
    model, kind, _, _ = _backend(name)
    a = adapter(model)
    kw = a.forward_kwargs(return_type=None, stop_at_layer=1)
    assert a.supports_stop_at_layer == (kind != "hooked_encoder") == ("stop_at_layer" in kw)
    tokens = random_tokens(batch=1, pos=5, seed=4)
    seen: dict[str, torch.Tensor] = {}
    hook = ("blocks.0.hook_resid_post", lambda x, hook: seen.__setitem__("resid", x.detach()))
    with torch.no_grad(), model.hooks(fwd_hooks=[hook], reset_hooks_end=True):
        out = model(tokens, **a.forward_kwargs(return_type="logits", stop_at_layer=1))
    if a.supports_stop_at_layer:  # the residual stream entering block 1, not logits
        torch.testing.assert_close(out, seen["resid"])
    else:
        assert out.shape[-1] == model.cfg.d_vocab


@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_padding_mask_keeps_padded_keys_out_or_is_refused(name: str) -> None:
    """Brute force: with the adapter's mask arguments, every query's pattern is 0 on the padded keys and
    the real rows of a padded text equal the text run alone; a model that would attend to them refuses."""
    model, kind, encoder, _ = _backend(name)
    a = adapter(model)
    tokens = random_tokens(batch=2, pos=6, seed=5)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    if not a.honours_attention_mask:
        assert name == "hooked_bidirectional"
        with pytest.raises(ValueError, match="ignores attention masks"):
            a.forward_kwargs(attention_mask=mask)
        with pytest.raises(ValueError, match="ignores attention masks"):
            a.check_attention_mask()
        return
    a.check_attention_mask()
    kw = a.forward_kwargs(return_type=None, attention_mask=mask.bool())
    key = "one_zero_attention_mask" if kind == "hooked_encoder" else "attention_mask"
    assert set(kw) == {"return_type", key} and kw[key].dtype == torch.long and torch.equal(kw[key], mask)
    if not encoder:
        return  # a decoder's padding sits right of its text: nothing to check beyond the arguments
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        ("blocks.1.attn.hook_pattern", lambda x, hook: seen.__setitem__("pattern", x.detach())),
        ("blocks.1.attn.hook_z", lambda x, hook: seen.__setitem__("z", x.detach())),
    ]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        model(tokens, **kw)
    padded_pattern, padded_z = seen["pattern"], seen["z"]
    assert float(padded_pattern[1, :, :4, 4:].abs().max()) == 0.0
    with torch.no_grad(), model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        model(tokens[1:, :4], **a.forward_kwargs(return_type=None))
    torch.testing.assert_close(padded_z[1, :4], seen["z"][0], atol=1e-5, rtol=1e-5)


@needs_hooked
def test_start_at_layer_resumes_a_hooked_transformer_exactly() -> None:
    model = make_tiny()
    a = adapter(model)
    assert a.supports_start_at_layer
    tokens = random_tokens(batch=2, pos=6, seed=6)
    _, cache = model.run_with_cache(tokens)
    with torch.no_grad():
        resumed = model(cache["blocks.1.hook_resid_pre"], start_at_layer=1, tokens=tokens)
    torch.testing.assert_close(resumed, _logits(model, tokens))
    assert not adapter(_hooked(positional_embedding_type="shortformer")).supports_start_at_layer


@pytest.mark.parametrize("name", ["hooked_encoder", "bridge", "bridge_encoder"])
def test_other_backends_do_not_resume_at_a_layer(name: str) -> None:
    model = _backend(name)[0]
    a = adapter(model)
    assert not a.supports_start_at_layer and not a.unembeds_positions


@needs_hooked
@pytest.mark.parametrize(("norm", "cap"), [("LN", None), ("RMS", 3.0), (None, None)])
def test_a_hooked_transformer_unembeds_chosen_positions(norm: str | None, cap: float | None) -> None:
    """What ``target_logprob`` does: ``stop_at_layer=n_layers`` then :meth:`logits` on some positions equals
    the full forward's logits there."""
    model = _hooked(normalization_type=norm, output_logits_soft_cap=cap or -1.0)
    a = adapter(model)
    assert a.unembeds_positions and a.logit_soft_cap == cap
    assert a.final_norm is getattr(model, "ln_final", None) and (a.final_norm is None) == (norm is None)
    assert a.final_norm_scale_hook == (None if norm is None else "ln_final.hook_scale")
    assert a.W_U is model.W_U and a.b_U is model.b_U
    tokens = random_tokens(batch=2, pos=7, seed=7)
    cols = torch.tensor([1, 4, 5])
    with torch.no_grad():
        resid = model(tokens, stop_at_layer=model.cfg.n_layers)
        torch.testing.assert_close(a.logits(resid[:, cols]), _logits(model, tokens)[:, cols])


@pytest.mark.parametrize("norm", ["LN", "RMS"])
def test_a_bridge_maps_the_stream_before_its_final_norm_to_its_logits(norm: str) -> None:
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        n_layers=2, d_model=16, n_ctx=16, d_head=4, n_heads=4, d_mlp=32, act_fn="gelu", d_vocab=50,
        normalization_type=norm, seed=1,
    )  # fmt: skip
    model = TransformerBridge.boot_native(cfg).eval()
    a = adapter(model)
    assert a.final_norm is model.ln_final and a.final_norm_scale_hook == "ln_final.hook_scale"
    assert a.W_U.shape == (16, 50) and a.b_U.shape == (50,) and a.logit_soft_cap is None
    tokens = random_tokens(batch=2, pos=6, seed=8)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        torch.testing.assert_close(a.logits(cache["ln_final.hook_in"]), logits)


@pytest.mark.parametrize("name", ["hooked_encoder", "bridge_encoder"])
def test_an_encoder_has_no_unembedding_of_the_stream(name: str) -> None:
    model = _backend(name)[0]
    a = adapter(model)
    with pytest.raises(TypeError, match="encoder"):
        a.logits(torch.zeros(1, 2, 16))


def test_a_duck_typed_model_is_other() -> None:
    m = SimpleNamespace(cfg=SimpleNamespace(attention_dir="causal", device="cpu", n_layers=2))
    a = adapter(m)
    assert (a.kind, a.is_bridge, a.is_encoder) == ("other", False, False)
    assert a.supports_stop_at_layer and a.honours_attention_mask and not a.supports_start_at_layer
    assert not a.unembeds_positions and a.device == torch.device("cpu") and a.dtype == torch.float32
    assert adapter(m) is not a  # a SimpleNamespace cannot be a weak key: no cache, same answers
    assert adapter(SimpleNamespace(cfg=SimpleNamespace(attention_dir="bidirectional"))).is_encoder


def test_the_adapter_does_not_keep_its_model_alive() -> None:
    model = make_tiny()
    a = adapter(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    with pytest.raises(ReferenceError):
        _ = a.model


def test_tl_version_is_the_installed_one() -> None:
    assert version("transformer-lens") == TL_VERSION


# --------------------------------------------------------------------------- the structure rule

PKG = Path(mechgeom.__file__).parent
#: TransformerLens' model classes: only the models layer may test for them.
TL_CLASSES = {
    "HookedTransformer",
    "HookedEncoder",
    "HookedEncoderDecoder",
    "HookedRootModule",
    "TransformerBridge",
}
TL_DISTRIBUTIONS = {"transformer-lens", "transformer_lens"}


def _is_class_name(node: ast.AST) -> bool:
    """``type(x).__name__``, ``x.__class__.__name__`` or ``type(x).__qualname__``."""
    if not (isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__")):
        return False
    v = node.value
    is_type_call = isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "type"
    return is_type_call or (isinstance(v, ast.Attribute) and v.attr == "__class__")


def _names(node: ast.AST) -> set[str]:
    """The names a class argument refers to: ``C``, ``m.C`` and the elements of a tuple of them."""
    if isinstance(node, ast.Tuple):
        return {n for e in node.elts for n in _names(e)}
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.BinOp):  # C1 | C2
        return _names(node.left) | _names(node.right)
    return set()


def backend_tests(source: str) -> list[str]:
    """Every backend test in ``source``: ``is_bridge``; a comparison involving a class name or a
    TransformerLens class name as a string; ``isinstance``/``issubclass`` against a TransformerLens model
    class, or importing one; ``TL_VERSION``, ``transformer_lens.__version__`` or a call given the
    distribution's name (``version("transformer-lens")``)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name) and node.id in ("is_bridge", "TL_VERSION"):
            found.append(f"line {line}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ("is_bridge", "TL_VERSION"):
            found.append(f"line {line}: .{node.attr}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "__version__"
            and "transformer_lens" in ast.unparse(node)
        ):
            found.append(f"line {line}: transformer_lens.__version__")
        elif isinstance(node, ast.alias) and (
            node.name in ("is_bridge", "TL_VERSION") or node.name.split(".")[-1] in TL_CLASSES
        ):
            found.append(f"line {line}: imports {node.name}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
            if any(_is_class_name(o) for o in operands) or strings & TL_CLASSES:
                found.append(f"line {line}: a class-name comparison")
        elif isinstance(node, ast.Call):
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if (
                func in ("isinstance", "issubclass")
                and len(node.args) == 2
                and _names(node.args[1]) & TL_CLASSES
            ):
                found.append(f"line {line}: {func}(..., {sorted(_names(node.args[1]) & TL_CLASSES)})")
            args = [*node.args, *(k.value for k in node.keywords)]
            if any(isinstance(x, ast.Constant) and x.value in TL_DISTRIBUTIONS for x in args):
                found.append(f"line {line}: {func}() of the TransformerLens distribution")
            if func in ("getattr", "hasattr") and any(
                isinstance(x, ast.Constant) and x.value in TL_CLASSES for x in node.args
            ):
                found.append(f"line {line}: {func}() of a TransformerLens model class")
            if any(_is_class_name(x) for x in node.args) and func in (
                "startswith",
                "endswith",
                "count",
                "find",
            ):
                found.append(f"line {line}: a class-name test")
            if isinstance(node.func, ast.Attribute) and _is_class_name(node.func.value):
                found.append(f"line {line}: a class-name test ({func})")
    return found


def test_no_module_above_the_models_layer_tests_the_backend() -> None:
    """Backend knowledge lives in ``mechgeom/models/``: everything else asks ``adapter(model)``."""
    models = PKG / "models"
    found = {
        str(p.relative_to(PKG)): hits
        for p in sorted(PKG.rglob("*.py"))
        if models not in p.parents and (hits := backend_tests(p.read_text(encoding="utf-8")))
    }
    assert not found, found
    assert backend_tests((models / "adapter.py").read_text(encoding="utf-8"))  # the check reads real code


@pytest.mark.parametrize(
    "source",
    [
        'if type(model).__name__ == "HookedEncoder":\n    pass\n',
        'encoder = "Encoder" in type(model).__name__\n',
        "same = model.__class__.__name__ != name\n",
        'ok = type(model).__name__.startswith("Hooked")\n',
        'ok = kind == "TransformerBridge"\n',
        "from mechgeom.models import is_bridge\n",
        "if adapter(model).is_bridge:\n    pass\n",
        "from transformer_lens import HookedTransformer\n",
        "from transformer_lens.model_bridge import TransformerBridge as TB\n",
        "ok = isinstance(model, tl.HookedTransformer)\n",
        "ok = isinstance(model, (HookedEncoder, TransformerBridge))\n",
        "ok = issubclass(cls, HookedTransformer | HookedEncoder)\n",
        "from mechgeom.models import TL_VERSION\n",
        "four = mechgeom.models.TL_VERSION >= '4'\n",
        'v = version("transformer-lens")\n',
        'v = importlib.metadata.version(distribution_name="transformer_lens")\n',
        "v = transformer_lens.__version__\n",
        'three = hasattr(transformer_lens, "HookedEncoder")\n',
    ],
)
def test_the_backend_check_catches_each_form(source: str) -> None:
    assert backend_tests(source), source


@pytest.mark.parametrize(
    "source",
    [
        'raise TypeError(f"{type(model).__name__} is not an encoder")\n',
        'x = "a bidirectional HookedTransformer ignores attention masks"\n',
        "if adapter(model).is_encoder and adapter(model).supports_start_at_layer:\n    pass\n",
        "ok = isinstance(x, torch.Tensor)\n",
        "from transformer_lens.hook_points import HookPoint\n",
        'def f():\n    """>>> from transformer_lens.model_bridge import TransformerBridge"""\n',
        "v = mechgeom.__version__\n",
    ],
)
def test_the_backend_check_lets_adapter_calls_and_messages_through(source: str) -> None:
    assert not backend_tests(source), backend_tests(source)
