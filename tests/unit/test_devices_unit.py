"""Devices (issue 36, point 4): ``load_model(device=...)`` refuses an unusable device in one line naming it and
the devices there are (torch's own error is a bare ``AssertionError``), before reading any weights; and the
per-layer hot paths of the analyses do not go back to the host once per head or query."""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
from collections.abc import Callable

import pytest
import torch
from conftest import TEST_DEVICE, make_tiny, random_tokens
from reference_contribution import acts_of, assert_all_metrics_match, brute_force

import mechgeom
from mechgeom.analyses.contribution.weights import ContributionCollector
from mechgeom.hooks import run_hooks
from mechgeom.models import available_devices, check_device, load_model


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_cpu_is_always_there() -> None:
    assert available_devices()[0] == "cpu"
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("name", ["smollm2-135m", "minilm-l6", "gemma-3-270m"])
def test_cuda_without_cuda(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Checked first: no wheel, cache or weights are needed to get the error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as exc:
        load_model(name, device="cuda")
    msg = _one_line(exc)
    assert "device='cuda'" in msg and "no CUDA device" in msg and "available here: cpu" in msg


def test_cuda_index_past_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError) as exc:
        load_model("smollm2-135m", device="cuda:3")
    msg = _one_line(exc)
    assert "device='cuda:3'" in msg and "there is 1 CUDA device" in msg and "cpu, cuda:0" in msg
    assert check_device("cuda:0") == torch.device("cuda:0")  # within range: accepted (nothing is allocated)


def test_mps_without_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError) as exc:
        load_model("smollm2-135m", device="mps")
    msg = _one_line(exc)
    assert "device='mps'" in msg and "MPS" in msg and "available here: cpu" in msg


@pytest.mark.parametrize("bad", ["cdua", "gpu", "cuda:x", ""])
def test_misspelt_device(bad: str) -> None:
    with pytest.raises(ValueError) as exc:
        load_model("smollm2-135m", device=bad)
    msg = _one_line(exc)
    assert f"device={bad!r} is not a torch device" in msg and "available here: cpu" in msg


# --------------------------------------------------------------------------- analyses on MECHGEOM_TEST_DEVICE

ANALYSES = {
    "contribution": lambda m, t: mechgeom.contribution_weights(m, t),
    "contribution_last_query": lambda m, t: mechgeom.contribution_weights(m, t, queries=[-1]),
    "contribution_top_k": lambda m, t: mechgeom.contribution_weights(m, t, top_k=3),
    "contribution_overview": lambda m, t: mechgeom.contribution_overview(m, t),
    "sink_statistics": lambda m, t: mechgeom.sink_statistics(m, t),
    "token_selection": lambda m, t: mechgeom.token_selection(m, t),
    "classify_heads": lambda m, t: mechgeom.classify_heads(m, t),
    "head_stats": lambda m, t: mechgeom.head_stats(m, t),
    "attention_rollout": lambda m, t: mechgeom.attention_rollout(m, t),
    "source_rankings": lambda m, t: mechgeom.source_rankings(m, t),
}


def test_contribution_on_the_test_device_matches_the_brute_force() -> None:
    """Every metric of every layer with the model on ``MECHGEOM_TEST_DEVICE`` (GQA), against the float64
    brute force on the CPU; the result is on the CPU (its store device)."""
    model = make_tiny(n_kv=2)
    tokens = random_tokens(2, 10)
    res = mechgeom.contribution_weights(model, tokens)
    assert res.intra["contribution"].device == torch.device("cpu")
    _, cache = model.run_with_cache(tokens.to(TEST_DEVICE))
    for li in range(model.cfg.n_layers):
        alpha, v, _ = acts_of(cache, li)
        ref = brute_force(alpha, v, model.W_O[li])
        intra = {k: t[:, li] for k, t in res.intra.items()}
        inter = {k: t[:, li] for k, t in res.inter.items()}
        assert_all_metrics_match(intra, inter, ref, atol=1e-4)


def test_streamed_payload_stays_on_the_model_device() -> None:
    """``on_layer`` gets the layer's metrics where they were computed (no host copy per layer) unless
    ``store_device`` says otherwise; the values are those of the stored result."""
    model = make_tiny()
    tokens = random_tokens(2, 8)
    got: dict[int, dict] = {}

    def keep(layer: int, payload: dict) -> None:
        got[layer] = {m: t.clone() for m, t in payload["intra"].items()}

    col = ContributionCollector(model, on_layer=keep)
    run_hooks(model, tokens, col.fwd_hooks)
    stored = mechgeom.contribution_weights(model, tokens)
    for li in range(model.cfg.n_layers):
        for m, t in got[li].items():
            assert t.device == next(model.parameters()).device
            torch.testing.assert_close(t.cpu(), stored.intra[m][:, li], equal_nan=True)
    col = ContributionCollector(model, on_layer=keep, store_device="cpu")
    run_hooks(model, tokens, col.fwd_hooks)
    assert all(t.device == torch.device("cpu") for t in got[0].values())


def _tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor a result holds (dataclass fields, dicts, lists), by path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.update(_tensors(getattr(obj, f.name), f"{prefix}.{f.name}"))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}[{k!r}]"))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}[{i}]"))
    return out


@pytest.mark.skipif(
    TEST_DEVICE == "cpu", reason="compares MECHGEOM_TEST_DEVICE with the CPU: set MECHGEOM_TEST_DEVICE=cuda"
)
@pytest.mark.parametrize("name", list(ANALYSES))
def test_every_analysis_on_the_test_device_matches_the_cpu(name: str) -> None:
    """The same weights (drawn on the CPU) on the test device and on the CPU give the same result; each
    tensor of it on the CPU (the default store) or on the model's device (source_rankings keeps its ranks
    where the masking hooks that use them run)."""
    tokens = random_tokens(2, 10)
    on_dev = _tensors(ANALYSES[name](make_tiny(n_kv=2), tokens))
    on_cpu = _tensors(ANALYSES[name](make_tiny(n_kv=2, device="cpu"), tokens))
    assert on_dev.keys() == on_cpu.keys() and on_dev
    for path, t in on_dev.items():
        assert t.device.type in ("cpu", torch.device(TEST_DEVICE).type), path
        t = t.cpu()
        if t.is_floating_point():
            torch.testing.assert_close(t, on_cpu[path], atol=1e-4, rtol=1e-4, equal_nan=True, msg=path)
        else:
            assert torch.equal(t, on_cpu[path]), path


# --------------------------------------------------------------------------- host syncs

#: The tensor methods that copy a value to the host (a device sync on a GPU).
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _count_syncs(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], object]) -> collections.Counter:
    """Host conversions made by mechgeom's own code (not torch's or TransformerLens') during ``fn()``, by
    (method, file, line)."""
    counts: collections.Counter = collections.Counter()

    def counting(name: str) -> Callable[..., object]:
        orig = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            code = sys._getframe(1).f_code
            if f"{os.sep}mechgeom{os.sep}" in code.co_filename:
                counts[(name, code.co_filename.rsplit(os.sep + "mechgeom" + os.sep, 1)[1])] += 1
            return orig(self, *args, **kwargs)

        return wrapper

    with monkeypatch.context() as mp:
        for name in SYNCS:
            mp.setattr(torch.Tensor, name, counting(name))
        fn()
    return counts


@pytest.mark.parametrize("name", list(ANALYSES))
def test_host_syncs_do_not_grow_with_heads_or_queries(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """No ``.item()`` / ``bool()`` / ``.tolist()`` ... per head or per query: an analysis of a model with 4x
    the heads on 3x the tokens makes exactly as many host conversions."""
    small = (make_tiny(n_heads=2, d_head=4), random_tokens(2, 8))
    big = (make_tiny(n_heads=8, d_head=4, n_kv=4), random_tokens(2, 24))
    few = _count_syncs(monkeypatch, lambda: ANALYSES[name](*small))
    many = _count_syncs(monkeypatch, lambda: ANALYSES[name](*big))
    grown = {k: (few.get(k, 0), n) for k, n in many.items() if n > few.get(k, 0)}
    assert not grown, f"host conversions that grow with heads or queries (small, big): {grown}"


def test_query_rows_are_chosen_once_per_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """``queries=`` / ``top_k=``: the kept rows (a host-side selection) are worked out once per forward pass,
    not once per layer."""
    from mechgeom.analyses.contribution import weights

    calls: list[int] = []
    orig = weights.query_index
    monkeypatch.setattr(weights, "query_index", lambda *a: calls.append(1) or orig(*a))
    model, tokens = make_tiny(n_layers=4), random_tokens(2, 8)
    res = mechgeom.contribution_weights(model, tokens, queries=[-1, 2])
    assert len(calls) == 1
    for li in range(4):  # the rows (in order: 2, then the last, 7) are still right in every layer
        full = mechgeom.contribution_weights(model, tokens, layers=li)
        torch.testing.assert_close(
            res.intra["contribution"][:, li], full.intra["contribution"][:, 0][:, :, [2, 7]], equal_nan=True
        )
    calls.clear()
    seen: list[int] = []
    col = ContributionCollector(model, top_k=2, on_layer=lambda layer, p: seen.append(layer))
    run_hooks(model, tokens, col.fwd_hooks)
    run_hooks(model, tokens, col.fwd_hooks)  # a second pass chooses its rows again
    assert len(calls) == 2 and seen == [0, 1, 2, 3] * 2
