"""One token validator for every entry point (issue: inputs that fail clearly), checked filters of the
result tables, and results built from a cache without tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny, random_tokens

import mechgeom.models
from mechgeom import cli
from mechgeom.analyses.contribution.weights import contribution_weights, contribution_weights_from_cache
from mechgeom.analyses.faithfulness import source_rankings
from mechgeom.analyses.faithfulness.curves import perplexity_curves
from mechgeom.analyses.heads import head_stats
from mechgeom.analyses.heads.pruning import retention_curve, single_head_sweep
from mechgeom.analyses.heads.taxonomy import classify_heads
from mechgeom.analyses.selection.collector import token_selection, token_selection_from_cache
from mechgeom.analyses.sinks.statistics import sink_statistics

N_CTX, D_VOCAB = 32, 50  # make_tiny's defaults

ENTRY_POINTS: dict[str, Callable[[Any, Any], Any]] = {
    "contributions": contribution_weights,
    "faithfulness_rankings": source_rankings,
    "faithfulness_curves": partial(
        perplexity_curves,
        metrics=["attention"],
        rates=[0.5],
        modes=["comprehensiveness"],
        n_boot=10,
        verbose=False,
    ),
    "sinks": sink_statistics,
    "selection": partial(token_selection, ns=[1]),
    "taxonomy": classify_heads,
    "head_stats": head_stats,
    "single_head_sweep": partial(single_head_sweep, heads=[(0, 0)]),
    "retention_curve": lambda m, x: retention_curve(
        m, [(la, h) for la in range(2) for h in range(4)], {"c": x}, levels=[0.5]
    ),
}

BAD_INPUTS = {
    "float_tensor": (torch.rand(1, 6), TypeError, "float32"),
    "bool_tensor": (torch.ones(1, 6, dtype=torch.bool), TypeError, "bool"),
    "negative_id": (torch.tensor([[1, 2, -3, 4]]), ValueError, "token id -3"),
    "id_at_d_vocab": (torch.tensor([[1, 2, D_VOCAB, 4]]), ValueError, f"token id {D_VOCAB}"),
    "huge_id_in_list": ([1, 2, 2**70], ValueError, f"token id {2**70}"),
    "too_long": (torch.zeros(1, N_CTX + 1, dtype=torch.long), ValueError, f"n_ctx={N_CTX}"),
    "empty_tensor": (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty"),
    "empty_list": ([], ValueError, "empty"),
    "blank_text": ("   ", ValueError, "empty text"),
    "mixed_list": ([1, "a"], TypeError, "only strings"),
    "three_dims": (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, "shape"),
    "a_dict": ({"a": 1}, TypeError, "dict"),
}


@pytest.fixture(scope="module")
def model() -> Any:
    return make_tiny(n_kv=2, seed=41)


@pytest.mark.parametrize("bad", list(BAD_INPUTS), ids=list(BAD_INPUTS))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS), ids=list(ENTRY_POINTS))
def test_every_entry_point_refuses_bad_tokens(model: Any, entry: str, bad: str) -> None:
    value, exc, fragment = BAD_INPUTS[bad]
    with pytest.raises(exc, match=fragment.replace("[", r"\[")):
        ENTRY_POINTS[entry](model, value)
    assert not any(len(hp.fwd_hooks) for hp in model.hook_dict.values())


@pytest.mark.parametrize(
    "entry", ["faithfulness_curves", "selection", "taxonomy", "single_head_sweep", "retention_curve"]
)
def test_too_short_for_the_analysis_is_a_clear_error(model: Any, entry: str) -> None:
    with pytest.raises(ValueError, match="needs at least 2 positions per text, got 1"):
        ENTRY_POINTS[entry](model, torch.tensor([[3]]))


def test_head_stats_start_pos_beyond_the_text(model: Any) -> None:
    with pytest.raises(ValueError, match="needs at least 6 positions per text, got 4"):
        head_stats(model, random_tokens(2, 4), start_pos=5)


def test_a_list_of_ints_is_one_sequence(model: Any) -> None:
    ids = [3, 14, 15, 9, 26, 5]
    from_list = contribution_weights(model, ids)
    from_tensor = contribution_weights(model, torch.tensor(ids))
    assert from_list.tokens.tolist() == [ids]
    for name, t in from_tensor.intra.items():
        assert torch.equal(from_list.intra[name], t), name
    # uint8 and int32 ids are integer ids too
    small = contribution_weights(model, torch.tensor([ids], dtype=torch.uint8))
    assert torch.equal(small.intra["contribution"], from_tensor.intra["contribution"])


def test_n_larger_than_every_source_count_warns(model: Any) -> None:
    with pytest.warns(
        UserWarning, match=r"N=\[8, 16\] is larger than every query's source count \(at most 5"
    ):
        res = token_selection(model, random_tokens(1, 5), ns=[1, 8, 16], layers=[0])
    assert res.per_query["f_top"][..., 1:].isnan().all()
    assert not res.per_query["f_top"][..., 0].isnan().all()


def test_cli_reports_bad_text_in_one_line(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(mechgeom.models, "load_model", lambda *a, **k: model)
    monkeypatch.setattr(model, "to_tokens", lambda text, **k: torch.arange(N_CTX + 5)[None], raising=False)
    with caplog.at_level(logging.ERROR, logger="mechgeom"):
        code = cli.main(["contributions", "--text", "long", "--out", str(tmp_path / "c.csv")])
    assert code == 2
    assert f"longer than the model's n_ctx={N_CTX}" in caplog.text
    assert not (tmp_path / "c.csv").exists()


# --------------------------------------------------------------------------- checked filters


def test_contribution_to_frame_filters_name_the_valid_range(model: Any) -> None:
    res = contribution_weights(model, random_tokens(2, 6))
    n_heads = model.cfg.n_heads
    with pytest.raises(IndexError, match=rf"head -1 out of range \(0..{n_heads - 1}\)"):
        res.to_frame(heads=[-1])
    with pytest.raises(IndexError, match=rf"head {n_heads} out of range \(0..{n_heads - 1}\)"):
        res.to_frame(heads=[n_heads])
    with pytest.raises(
        IndexError, match=r"query 99 is outside text 0, which has 6 real tokens \(valid: -6..5"
    ):
        res.to_frame(query=99)
    with pytest.raises(IndexError, match=r"batch 2 out of range \(0..1\)"):
        res.to_frame(batch=2)
    with pytest.raises(IndexError, match=r"layer 7 was not analysed; analysed layers are \[0, 1\]"):
        res.to_frame(layers=[7])
    # a valid filter returns exactly the asked rows, labelled with the head they come from
    frame = res.to_frame(heads=[n_heads - 1], query=5, batch=1)
    assert set(frame["head"]) == {n_heads - 1} and set(frame["query"]) == {5}
    assert frame["contribution"].tolist() == pytest.approx(
        res.intra["contribution"][1, :, n_heads - 1, 5, :6].flatten().tolist()
    )


def test_other_frames_check_their_filters(model: Any) -> None:
    ranks = source_rankings(model, random_tokens(2, 6), ["attention"])["attention"]
    with pytest.raises(IndexError, match=r"batch 2 out of range \(0..1\)"):
        ranks.to_frame(batch=2)
    with pytest.raises(IndexError, match="layer 5 was not ranked"):
        ranks.to_frame(layer=5)
    sinks = sink_statistics(model, random_tokens(2, 6))
    with pytest.raises(IndexError, match=r"head -1 out of range \(0..3\)"):
        sinks.query_frame(heads=[-1])
    with pytest.raises(IndexError, match="layer 3 was not analysed"):
        sinks.query_frame(layers=[3])


def test_from_cache_without_tokens_has_no_token_columns(model: Any) -> None:
    tokens = random_tokens(2, 6)
    _, cache = model.run_with_cache(tokens)
    res = contribution_weights_from_cache(model, cache)
    assert res.tokens is None
    frame = res.to_frame()
    assert "query_token" not in frame and "key_token" not in frame
    # every text (to_frame's default): 2 texts x 6·7/2 (query, key) pairs per head
    assert len(frame) == 2 * model.cfg.n_layers * model.cfg.n_heads * 21
    assert sorted(frame["batch"].unique()) == [0, 1]
    with_tokens = contribution_weights_from_cache(model, cache, tokens=tokens)
    assert torch.equal(with_tokens.tokens, tokens)
    sel = token_selection_from_cache(model, cache, ns=[1])
    assert sel.tokens is None
