"""The Collector/Result contract of ``mechgeom.analyses.base``, held by every analysis.

- every collector is a :class:`~mechgeom.analyses.base.Collector` (no duck-typed collector is left), declares its
  layers, and gives the one "nothing was collected" error;
- every entry point has the shape ``analysis(model, tokens_or_text, *, layers=None, cache=None, extra_hooks=(),
  verbose=False, ...)``, and ``cache=`` gives the result of a live pass;
- every result is a :class:`~mechgeom.analyses.base.Result` whose ``to_frame()`` covers every text and whose
  ``summary()`` needs no argument;
- the ``*_from_cache`` twins still work, with a ``DeprecationWarning`` naming the replacement.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pandas as pd
import pytest
import torch
from conftest import make_tiny, random_tokens

import mechgeom
from mechgeom.analyses.base import Collector, Result, check_cache, collect
from mechgeom.analyses.faithfulness import DEFAULT_RATES, FAITHFULNESS_METRICS
from mechgeom.hooks import LayerCollector, has_hooks

ENTRY_POINTS = ["contribution_weights", "sink_statistics", "token_selection", "classify_heads", "head_stats"]


def _all_classes() -> list[type]:
    import mechgeom.analyses as pkg

    out = []
    for info in pkgutil.walk_packages(pkg.__path__, "mechgeom.analyses."):
        mod = importlib.import_module(info.name)
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == mod.__name__]
    return out


def test_every_collector_is_a_collector_and_every_result_a_result() -> None:
    classes = _all_classes()
    duck = [
        c.__name__
        for c in classes
        if hasattr(c, "fwd_hooks") and callable(getattr(c, "result", None)) and not issubclass(c, Collector)
    ]
    assert not duck, f"collectors outside the contract: {duck}"
    results = [c for c in classes if c.__name__.endswith(("Result", "Curves", "Check", "Overview", "Stats"))]
    assert len(results) >= 10
    outside = [c.__name__ for c in results if not issubclass(c, Result)]
    assert not outside, f"results outside the contract: {outside}"
    for c in results:
        for method in ("to_frame", "summary"):
            sig = inspect.signature(getattr(c, method))
            required = [
                p.name
                for p in list(sig.parameters.values())[1:]
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            assert not required, f"{c.__name__}.{method} requires {required}"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_has_the_one_shape(name: str) -> None:
    params = inspect.signature(getattr(mechgeom, name)).parameters
    names = list(params)
    assert names[:2] == ["model", "tokens_or_text"], names
    for kw, default in (("layers", None), ("cache", None), ("extra_hooks", ()), ("verbose", False)):
        assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY, (name, kw)
        assert params[kw].default == default, (name, kw)


def _frames_equal(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert len(a) > 0
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_cache_gives_the_result_of_a_live_pass(name: str) -> None:
    model = make_tiny(n_layers=2, n_kv=2, seed=7)
    tokens = random_tokens(3, 8, seed=1)
    fn = getattr(mechgeom, name)
    live = fn(model, tokens)
    _, cache = model.run_with_cache(tokens)
    cached = fn(model, tokens, cache=cache)
    _frames_equal(live.to_frame(), cached.to_frame())
    assert cached.summary().keys() == live.summary().keys()
    without = fn(model, None, cache=cache)  # no tokens: a result all the same
    _frames_equal(
        live.to_frame().drop(columns=["query_token", "key_token"], errors="ignore"), without.to_frame()
    )
    with pytest.raises(ValueError, match="extra_hooks act during a forward pass"):
        fn(model, tokens, cache=cache, extra_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z)])
    assert not has_hooks(model)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("contribution_weights_from_cache", "contribution_weights"),
        ("sink_statistics_from_cache", "sink_statistics"),
        ("token_selection_from_cache", "token_selection"),
        ("classify_heads_from_cache", "classify_heads"),
        ("head_stats_from_cache", "head_stats"),
    ],
)
def test_from_cache_twins_warn_and_agree(old: str, new: str) -> None:
    model = make_tiny(n_layers=2, seed=3)
    tokens = random_tokens(2, 7, seed=2)
    _, cache = model.run_with_cache(tokens)
    with pytest.warns(DeprecationWarning, match=rf"{old}.*deprecated.*{new}\(model, tokens, cache=cache\)"):
        twin = getattr(mechgeom, old)(model, cache)
    _frames_equal(twin.to_frame(), getattr(mechgeom, new)(model, None, cache=cache).to_frame())


def test_to_frame_covers_every_text_by_default() -> None:
    model = make_tiny(n_layers=1, seed=2)
    res = mechgeom.contribution_weights(model, random_tokens(3, 5, seed=4))
    assert sorted(res.to_frame()["batch"].unique()) == [0, 1, 2]
    assert sorted(res.to_frame(batch=1)["batch"].unique()) == [1]
    assert (res.to_frame()["layer"].dtype.kind, res.to_frame()["head"].dtype.kind) == ("i", "i")


def test_a_collector_missing_layers_gives_the_one_error() -> None:
    model = make_tiny(n_layers=3, seed=1)
    for col in (
        mechgeom.SinkCollector(model, [0, 2]),
        mechgeom.TaxonomyCollector(model, 1),
        mechgeom.ContributionCollector(model, [2]),
        mechgeom.HeadStatsCollector(model),
        mechgeom.SelectionCollector(model, [1], ns=[1]),
    ):
        assert col.layers and all(isinstance(la, int) for la in col.layers)
        with pytest.raises(RuntimeError, match=r"no activations were collected for layer\(s\).*feed_cache"):
            col.result()


def test_collect_accepts_only_collectors() -> None:
    model = make_tiny(n_layers=1, seed=1)

    class Duck:  # the hooks and result of a collector, without the contract
        def __init__(self) -> None:
            self.reader = LayerCollector(model, None, lambda acts: None)
            self.fwd_hooks = self.reader.fwd_hooks

        def result(self, tokens=None):
            return None

    with pytest.raises(TypeError, match=r"collectors\[0\] \(Duck\) is not a collector.*Collector"):
        collect(model, random_tokens(1, 4), [Duck()])


def test_head_statistics_share_the_reader_with_their_taxonomy() -> None:
    """0.2 nested a TaxonomyCollector whose extra hooks stopped the readers from being shared."""
    model = make_tiny(n_layers=2, seed=9)
    col = mechgeom.HeadStatsCollector(model, taxonomy=True)
    assert len(col.fwd_hooks) == 3 * model.cfg.n_layers  # one reader: three hooks per layer
    tokens = random_tokens(4, 8, seed=3)
    stats = collect(model, tokens, col, batch_size=2)
    alone = mechgeom.classify_heads(model, tokens, batch_size=2)
    _frames_equal(stats.taxonomy.to_frame(), alone.to_frame())


def test_a_cache_without_its_batch_axis_is_refused_with_the_way_out() -> None:
    model = make_tiny(n_layers=1, seed=1)
    _, cache = model.run_with_cache(random_tokens(1, 5), remove_batch_dim=True)
    with pytest.raises(ValueError, match=r"remove_batch_dim=True.*without it"):
        mechgeom.contribution_weights(model, None, cache=cache)
    with pytest.raises(KeyError, match="names_filter"):
        check_cache({}, [0])


def test_the_result_of_a_collector_holds_cpu_tokens() -> None:
    model = make_tiny(n_layers=1, seed=1)
    tokens = random_tokens(2, 5, seed=6)
    res = collect(model, tokens, mechgeom.SinkCollector(model))
    assert torch.equal(res.tokens, tokens) and res.tokens.device.type == "cpu"


#: Every analysis entry point: its input first (texts or token ids, or task items), then keyword-only options.
ALL_ENTRY_POINTS = {
    **dict.fromkeys(
        [
            *ENTRY_POINTS,
            "contribution_overview",
            "encoder_sink_statistics",
            "sink_ablation",
            "convexity_check",
            "convexity_by_intervention",
            "single_head_sweep",
            "perplexity_curves",
            "embedding_curves",
            "source_rankings",
        ],
        "tokens_or_text",
    ),
    "task_accuracy_curves": "items",
}
#: Options that mean the same thing in every entry point that has them, with their one default.
SHARED_DEFAULTS = {
    "layers": None,
    "cache": None,
    "extra_hooks": (),
    "verbose": False,
    "seed": 0,
    "batch_size": 8,
    "scope": "intra",
    "checkpoint": None,
    "executor": None,
    "n_boot": 1000,
    "sink_positions": None,
    "attention_mask": None,
    "metrics": FAITHFULNESS_METRICS,
    "rates": DEFAULT_RATES,
    "modes": ("comprehensiveness", "sufficiency"),
}


@pytest.mark.parametrize("name", sorted(ALL_ENTRY_POINTS))
def test_entry_points_take_their_input_by_position_and_options_by_keyword(name: str) -> None:
    params = list(inspect.signature(getattr(mechgeom, name)).parameters.values())
    assert [p.name for p in params[:2]] == ["model", ALL_ENTRY_POINTS[name]], name
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:2])
    late = [p.name for p in params[2:] if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
    assert not late, f"{name}: {late} can be passed by position"
    for p in params[2:]:
        if p.name in SHARED_DEFAULTS:
            assert p.default == SHARED_DEFAULTS[p.name], (name, p.name, p.default)


def test_options_once_positional_still_work_for_a_release_with_a_warning() -> None:
    model = make_tiny(n_layers=1, seed=4)
    tokens = random_tokens(2, 6, seed=5)
    kw = dict(metrics=["attention"], rates=[0.0, 0.5], modes=["sufficiency"], n_boot=20)
    new = mechgeom.perplexity_curves(model, tokens, **kw)
    with pytest.warns(
        DeprecationWarning, match=r"perplexity_curves\(\.\.\., metrics, rates, modes\) by position"
    ):
        old = mechgeom.perplexity_curves(model, tokens, ["attention"], [0.0, 0.5], ["sufficiency"], n_boot=20)
    pd.testing.assert_frame_equal(old, new)
    with pytest.raises(TypeError, match="multiple values for argument 'metrics'"):
        mechgeom.perplexity_curves(model, tokens, ["attention"], metrics=["attention"])
    with pytest.raises(
        TypeError, match=r"takes 2 positional arguments \(then metrics, rates, modes by keyword\)"
    ):
        mechgeom.perplexity_curves(model, tokens, ["attention"], [0.5], ["sufficiency"], 2)
