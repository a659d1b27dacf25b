"""One value-bias convention, independent of loading (``docs/definitions.md`` §1.3, issue 36 point 2).

A tiny model with random non-zero ``b_V`` and ``b_O`` is analysed twice: as built (``hook_v`` holds
``x W_V + b_V``) and with its value biases folded into ``b_O`` by TransformerLens itself
(``HookedTransformer.fold_value_biases`` on 3.x, a bridge's ``enable_compatibility_mode(fold_value_biases=True)``
on both lines; ``fold_value_biases`` in ``tests/conftest.py``). The two models compute the same logits; every analysis must give the same numbers on both,
the contribution metrics must equal a brute force with ``vt = x W_V W_O`` built here from ``hook_pattern``,
the attention's input and the weights, and ``reconstruct_attn_out`` must reproduce ``hook_attn_out`` on both.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import pandas as pd
import pytest
import torch
from conftest import HAS_HOOKED, fold_value_biases, make_tiny, make_tiny_hf_bridge, random_tokens
from reference_contribution import assert_all_metrics_match, brute_force

from mechgeom.analyses.attribution.rollout import attention_rollout
from mechgeom.analyses.contribution.weights import contribution_weights, reconstruct_attn_out
from mechgeom.analyses.faithfulness.curves import perplexity_curves
from mechgeom.analyses.faithfulness.rankings import source_rankings
from mechgeom.analyses.heads.stats import head_stats
from mechgeom.analyses.selection.collector import token_selection
from mechgeom.analyses.sinks.statistics import sink_statistics
from mechgeom.hooks import LayerCollector, run_hooks
from mechgeom.hooks.interventions import head_ablation_hooks, masking_hooks, sink_mass_hooks, sink_value_hooks
from mechgeom.models.adapter import adapter

ATOL = 1e-5


def _with_random_b_V(model: Any, seed: int = 11) -> Any:
    """``model`` with every layer's value bias drawn at random (scale 1: as large as the values)."""
    g = torch.Generator().manual_seed(seed)
    names = [
        n
        for n, _ in model.named_parameters()
        if n.endswith(("b_V", "attn.v.bias", "v._original_component.bias"))
    ]
    assert len(names) == model.cfg.n_layers, names
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(torch.randn(params[n].shape, generator=g))
    return model


#: name -> (builder of the unfolded model, TransformerLens 3.x only)
MODELS = {  # GQA (2 KV heads for 4 query heads): each KV head's b_V serves a group of query heads
    "hooked": (lambda: make_tiny(seed=3, n_kv=2), True),
    "bridge": (lambda: _bridge(n_kv=2), False),
    "bridge_encoder": (lambda: make_tiny(seed=3, attention_dir="bidirectional"), False),
    # a bridge around a random Hugging Face Qwen2 (q/k/v biases, b_V drawn N(0, 1)) outside compatibility mode
    "bridge_hf_qwen2": (lambda: make_tiny_hf_bridge(compatibility_mode=False), False),
}


def _bridge(n_kv: int | None = None) -> Any:
    """A ``TransformerBridge.boot_native`` decoder (both lines) with a random ``b_O``."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        n_layers=2, d_model=16, n_ctx=32, d_head=8, n_heads=4, d_mlp=64, d_vocab=50, act_fn="gelu",
        n_key_value_heads=n_kv, normalization_type="LN", seed=3,
    )  # fmt: skip
    model = TransformerBridge.boot_native(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in model.original_model.layers:
            block.attn.o.bias.copy_(torch.randn(block.attn.o.bias.shape, generator=g) * 0.5)
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    build, hooked_only = MODELS[request.param]
    if hooked_only and not HAS_HOOKED:
        pytest.skip("HookedTransformer exists on TransformerLens 3.x only")
    model = build()
    if not request.param.startswith("bridge_hf"):  # the Hugging Face model has its random b_V already
        model = _with_random_b_V(model)
    try:
        folded = fold_value_biases(model)
    except Exception as err:  # pragma: no cover - a line whose bridge cannot fold
        pytest.skip(f"{type(model).__name__} cannot fold its value biases here: {err}")
    assert float(model.blocks[0].attn.b_V.abs().max()) > 0.1
    assert float(folded.blocks[0].attn.b_V.abs().max()) == 0.0
    return model, folded


def _tokens(model: Any) -> torch.Tensor:
    return random_tokens(batch=2, pos=8, seed=4)


def test_the_pair_computes_the_same_function(pair: tuple[Any, Any]) -> None:
    model, folded = pair
    t = _tokens(model)
    with torch.no_grad():
        torch.testing.assert_close(model(t), folded(t), atol=1e-5, rtol=1e-5)


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Every tensor, frame and nested result of ``a`` equals ``b``'s (floats to ``ATOL``, the rest exactly)."""
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():  # to ATOL of the tensor's scale (some hold sums over texts and queries)
            scale = max(1.0, float(a.double().nan_to_num(0.0, 0.0, 0.0).abs().max())) if a.numel() else 1.0
            torch.testing.assert_close(
                a.double(), b.double(), atol=ATOL * scale, rtol=ATOL, equal_nan=True, msg=where
            )
        else:
            assert torch.equal(a, b), where
    elif isinstance(
        a, pd.DataFrame
    ):  # numbers to ATOL of the frame's scale (perplexities and their differences)
        assert list(a.columns) == list(b.columns), where
        floats = [col for col in a.columns if pd.api.types.is_float_dtype(a[col])]
        scale = max([1.0, *(float(a[col].abs().max()) for col in floats)])
        for col in a.columns:
            if col in floats:
                torch.testing.assert_close(
                    torch.tensor(a[col].to_numpy()), torch.tensor(b[col].to_numpy()),
                    atol=ATOL * scale, rtol=ATOL, equal_nan=True, msg=f"{where}[{col}]",
                )  # fmt: skip
            else:
                assert a[col].tolist() == b[col].tolist(), f"{where}[{col}]"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")


ANALYSES = {
    "contribution_weights": lambda m, t: contribution_weights(m, t),
    "sink_statistics": lambda m, t: sink_statistics(m, t),
    "token_selection": lambda m, t: token_selection(m, t),
    "head_stats": lambda m, t: head_stats(m, t, taxonomy=True),
    "attention_rollout": lambda m, t: attention_rollout(m, t),
    "source_rankings": lambda m, t: source_rankings(m, t, metrics=["contribution", "value_weighted"]),
}


@pytest.mark.parametrize("analysis", list(ANALYSES))
def test_every_analysis_is_the_same_folded_or_not(pair: tuple[Any, Any], analysis: str) -> None:
    model, folded = pair
    t = _tokens(model)
    try:
        first = ANALYSES[analysis](model, t)
    except TypeError as err:  # a decoder analysis on the encoder
        assert adapter(model).is_encoder and "not a causal decoder" in str(err)
        pytest.skip(str(err))
    _assert_same(first, ANALYSES[analysis](folded, t), analysis)


def test_faithfulness_scores_are_the_same_folded_or_not(pair: tuple[Any, Any]) -> None:
    model, folded = pair
    if adapter(model).is_encoder:
        pytest.skip("perplexity curves are a decoder analysis")
    if not adapter(model).pattern_edits_take_effect(0):
        with pytest.raises(RuntimeError, match="hook_pattern"):
            perplexity_curves(model, _tokens(model), metrics=["contribution"], rates=(0.5,), n_boot=10)
        return
    kw = dict(metrics=["contribution", "attention"], rates=(0.0, 0.5, 1.0), n_boot=10)
    t = _tokens(model)
    _assert_same(perplexity_curves(model, t, **kw), perplexity_curves(folded, t, **kw), "perplexity_curves")


def _attention_input(model: Any, tokens: torch.Tensor, layer: int) -> torch.Tensor:
    """What ``W_V`` multiplies: ``blocks.{layer}.ln1`` applied to ``hook_resid_pre``."""
    seen: dict[str, torch.Tensor] = {}
    hook = (f"blocks.{layer}.hook_resid_pre", lambda x, hook: seen.__setitem__("x", x.detach()))
    with torch.no_grad(), model.hooks(fwd_hooks=[hook], reset_hooks_end=True):
        model(tokens, return_type=None)
        return model.blocks[layer].ln1(seen["x"])


def test_contribution_metrics_equal_a_brute_force_without_b_V(pair: tuple[Any, Any]) -> None:
    """``vt = x W_V W_O`` from the attention's input and the weights; ``alpha`` from ``hook_pattern``."""
    model, _ = pair
    t = _tokens(model)
    res = contribution_weights(model, t)
    _, cache = model.run_with_cache(t)
    for li, layer in enumerate(res.layers):
        attn = model.blocks[layer].attn
        x = _attention_input(model, t, layer)
        v_kv = torch.einsum("bpm,hmd->bphd", x, attn.W_V)  # no b_V
        ref = brute_force(
            cache[f"blocks.{layer}.attn.hook_pattern"], v_kv, attn.W_O, causal=not adapter(model).is_encoder
        )
        assert_all_metrics_match(
            {k: r[:, li] for k, r in res.intra.items()}, {k: r[:, li] for k, r in res.inter.items()}, ref
        )
        # the value bias is not negligible here: with it the metrics would differ
        with_bias = brute_force(
            cache[f"blocks.{layer}.attn.hook_pattern"],
            cache[f"blocks.{layer}.attn.hook_v"],
            attn.W_O,
            causal=not adapter(model).is_encoder,
        )
        assert float((with_bias["intra_contribution"] - ref["intra_contribution"]).abs().max()) > 1e-2


def test_reconstruct_attn_out_reproduces_hook_attn_out_on_both(pair: tuple[Any, Any]) -> None:
    t = _tokens(pair[0])
    for model in pair:
        col = LayerCollector(model)
        seen: dict[int, torch.Tensor] = {}

        def read(x: torch.Tensor, hook: Any, *, layer: int, seen: dict[int, torch.Tensor] = seen) -> None:
            seen[layer] = x.detach()

        reads = [(f"blocks.{la}.hook_attn_out", partial(read, layer=la)) for la in col.layers]
        run_hooks(model, t, [*col.fwd_hooks, *reads])
        for layer, acts in col.captured.items():
            assert not acts.any_modified
            out = seen[layer]
            torch.testing.assert_close(reconstruct_attn_out(model, acts), out, atol=1e-5, rtol=1e-5)


def test_an_unmodified_pass_is_not_marked_when_the_check_runs(pair: tuple[Any, Any]) -> None:
    """With another hook on ``hook_z`` the collector checks ``z - b_V`` against ``sum_j alpha (v_j - b_V)``."""
    model, _ = pair
    col = LayerCollector(model)
    noop = [(f"blocks.{la}.attn.hook_z", lambda x, hook: x) for la in col.layers]
    run_hooks(model, _tokens(model), [*noop, *col.fwd_hooks])
    assert all(not a.any_modified for a in col.captured.values())


def _logits(model: Any, tokens: torch.Tensor, hooks: list) -> torch.Tensor:
    with torch.no_grad(), model.hooks(fwd_hooks=hooks, reset_hooks_end=True):
        return model(tokens)


INTERVENTIONS = {
    "head_removal_zero": lambda m, t: head_ablation_hooks(m, [(0, 1), (1, 2)]),
    "head_removal_mean": lambda m, t: head_ablation_hooks(
        m,
        [(0, 1)],
        mode="mean",
        means=torch.randn(2, 4, m.cfg.d_head, generator=torch.Generator().manual_seed(2)),
    ),
    "sink_value_zero": lambda m, t: sink_value_hooks(m, mode="zero"),
    "sink_value_mean_norm": lambda m, t: sink_value_hooks(m, mode="mean_norm", scale=2.0),
    "source_masking": lambda m, t: masking_hooks(
        m,
        mask=torch.rand(t.shape[0], t.shape[1], t.shape[1], generator=torch.Generator().manual_seed(1)) < 0.4,
    ),
    "sink_mass": lambda m, t: sink_mass_hooks(m, 0.3),
}


@pytest.mark.parametrize("name", list(INTERVENTIONS))
def test_every_intervention_does_the_same_folded_or_not(pair: tuple[Any, Any], name: str) -> None:
    """The intervened logits agree (or both models refuse the intervention alike)."""
    model, folded = pair
    t = _tokens(model)
    outs = []
    for m in (model, folded):
        try:
            outs.append(_logits(m, t, INTERVENTIONS[name](m, t)))
        except RuntimeError as err:
            outs.append(str(err))
    if isinstance(outs[0], str):
        assert outs[0] == outs[1]
        return
    clean = _logits(model, t, [])
    assert float((outs[0] - clean).abs().max()) > 1e-3  # it does something
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
