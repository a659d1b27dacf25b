"""The fused sweep (``contribution_rows.c`` through :mod:`mechgeom._kernels.fused`) against the
brute force and the plain-torch sweep; how the kernel is built and when it is not; and the reader's skip of
:func:`~mechgeom.hooks.modified_mask` when no other hook can have touched a layer."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
from conftest import make_tiny, random_tokens
from reference_contribution import assert_all_metrics_match, brute_force

from mechgeom._kernels import build, fused
from mechgeom.analyses.contribution.geometry import INTER_METRICS, INTRA_METRICS, LayerGeometry
from mechgeom.analyses.contribution.weights import contribution_weights
from mechgeom.hooks import readers


@pytest.fixture
def kernel() -> None:
    if not fused.available(torch.zeros(1)):
        if os.environ.get("CI"):
            pytest.fail("the fused kernel did not build in CI")
        pytest.skip("no C compiler: the fused kernel is not built")


@pytest.fixture
def fresh_load():
    """``build.load`` forgets what it loaded, before and after the test."""
    build.load.cache_clear()
    yield
    build.load.cache_clear()


def _layer(B: int, H: int, Q: int, D: int, d_model: int, *, causal: bool, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, H, Q, Q, generator=g, dtype=dtype)
    if causal:
        scores = scores.masked_fill(torch.ones(Q, Q, dtype=torch.bool).triu(1), float("-inf"))
    alpha = scores.softmax(-1)
    v = torch.randn(B, Q, H, D, generator=g, dtype=dtype)
    z = torch.einsum("bhqk,bkhd->bqhd", alpha, v)
    W = torch.randn(H, D, d_model, generator=g, dtype=dtype) / d_model**0.5
    return alpha, v, z, W


def _both(monkeypatch: pytest.MonkeyPatch, make, intra=INTRA_METRICS, inter=INTER_METRICS):
    """``(fused, plain)`` results of ``make().compute(intra, inter)``."""
    got = make().compute(intra, inter)
    with monkeypatch.context() as m:
        m.setattr(fused, "available", lambda pattern: False)
        plain = make().compute(intra, inter)
    return got, plain


def _assert_same(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].isnan(), b[k].isnan()), k
        torch.testing.assert_close(a[k].nan_to_num(), b[k].nan_to_num(), atol=tol, rtol=tol, msg=k)


@pytest.fixture(scope="module")
def long_rows():
    """One layer of 520 keys (more than the kernel's 512-key chunk) and its brute force (computed once)."""
    alpha, v, z, W = _layer(1, 2, 520, 4, 6, causal=True, dtype=torch.float64, seed=1)
    return (alpha, v, z, W), brute_force(alpha, v, W)


@pytest.mark.parametrize("threads", [False, True])
def test_long_rows_match_the_brute_force(kernel, long_rows, monkeypatch, threads: bool) -> None:
    """Rows longer than a chunk, in the default blocks, on one thread and with the rows of each block (and the
    value Gram's tokens) shared between two threads."""
    monkeypatch.setattr(fused, "_MIN_PARALLEL", 0 if threads else 1 << 62)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    (alpha, v, z, W), ref = long_rows
    intra, inter = LayerGeometry(alpha, v, z, W).compute()
    assert_all_metrics_match(intra, inter, ref, atol=1e-9)
    assert (intra["contribution"] < 0).any()  # not degenerate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_threads_agree_with_the_plain_sweep_on_every_layout(kernel, monkeypatch, dtype) -> None:
    """Every C pass on two threads (no size threshold): batches of texts, an even head count (the Gram's
    pair at distance H/2 is met from both of its heads), causal and encoder with padding, modified heads."""
    monkeypatch.setattr(fused, "_MIN_PARALLEL", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for causal, mod in itertools.product([True, False], [False, True]):
        alpha, v, z, W = _layer(3, 4, 37, 6, 10, causal=causal, dtype=dtype, seed=21)
        modified = torch.rand(3, 4, 37, generator=torch.Generator().manual_seed(22)) < 0.2 if mod else None
        key_mask = None if causal else torch.arange(37)[None, :] < torch.tensor([[37], [30], [12]])

        def make(alpha=alpha, v=v, z=z, W=W, modified=modified, causal=causal, key_mask=key_mask):
            return LayerGeometry(alpha, v, z, W, modified=modified, causal=causal, key_mask=key_mask)

        (fi, fo), (pi, po) = _both(monkeypatch, make)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        _assert_same(fi, pi, tol)
        _assert_same(fo, po, tol)
        if causal and not mod and dtype == torch.float64:
            assert_all_metrics_match(fi, fo, brute_force(alpha, v, W), atol=1e-9)


def test_every_case_agrees_with_the_plain_sweep(kernel, monkeypatch) -> None:
    """Causal or not, float32 and float64, modified heads, zero outputs and values, metric subsets, blocks of
    4 and 128, with buffers reused between layers (``zeroed``) or fresh, and an encoder's padding."""
    subsets = [
        (INTRA_METRICS, INTER_METRICS),
        (["contribution"], ["value_weighted_normalized"]),
        (["factor_cos", "value_weighted"], ["contribution", "attention"]),
        (["head_share"], ["value_weighted"]),
    ]
    for causal, dtype, mod, zeros, bs, (intra, inter) in itertools.product(
        [True, False], [torch.float32, torch.float64], [False, True], [False, True], [4, 128], subsets
    ):
        alpha, v, z, W = _layer(2, 3, 11, 5, 7, causal=causal, dtype=dtype, seed=2)
        if zeros:
            z[:, 3] = 0  # every head's output is 0 at query 3: NaN rows
            v[:, 1, 0] = 0  # one zero projected value: cosine 0
        modified = torch.rand(2, 3, 11, generator=torch.Generator().manual_seed(3)) < 0.2 if mod else None
        key_mask = None if causal else torch.arange(11)[None, :] < torch.tensor([[11], [8]])

        def make(alpha=alpha, v=v, z=z, W=W, bs=bs, modified=modified, causal=causal, key_mask=key_mask):
            return LayerGeometry(
                alpha, v, z, W, block_size=bs, modified=modified, causal=causal, key_mask=key_mask
            )

        (fi, fo), (pi, po) = _both(monkeypatch, make, intra, inter)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        _assert_same(fi, pi, tol)
        _assert_same(fo, po, tol)

    # recycled buffers: a second layer written into the first one's tensors, entries after each query untouched
    alpha, v, z, W = _layer(1, 3, 40, 5, 7, causal=True, dtype=torch.float64, seed=4)
    first_i, first_o = LayerGeometry(alpha, v, z, W, block_size=16).compute()
    for t in [*first_i.values(), *first_o.values()]:  # a completed layer is 0 after each query
        assert not t.triu(1).any()
    alpha2, v2, z2, W2 = _layer(1, 3, 40, 5, 7, causal=True, dtype=torch.float64, seed=5)
    bufs_i = {k: t for k, t in first_i.items() if k != "attention"}
    for t in [*bufs_i.values(), *first_o.values()]:  # every entry that must be written holds garbage
        t.masked_fill_(torch.ones(40, 40, dtype=torch.bool).tril(), float("nan"))
    got = LayerGeometry(alpha2, v2, z2, W2, block_size=16).compute(
        out_intra=bufs_i, out_inter=first_o, zeroed=True
    )
    assert_all_metrics_match(*got, brute_force(alpha2, v2, W2), atol=1e-9)
    for t in [*bufs_i.values(), *first_o.values()]:
        assert t.triu(1).eq(0).all()


def test_a_completed_causal_layer_is_zero_after_each_query_on_both_sweeps(kernel, monkeypatch) -> None:
    """What ``zeroed=True`` relies on: every metric tensor of a causal layer, NaN rows (a zero output) and
    modified heads included, holds exactly 0 at each key after its query, whichever sweep wrote it."""
    alpha, v, z, W = _layer(2, 3, 23, 5, 7, causal=True, dtype=torch.float32, seed=6)
    z[:, 4] = 0  # NaN rows in the factors
    modified = torch.rand(2, 3, 23, generator=torch.Generator().manual_seed(7)) < 0.3

    def make() -> LayerGeometry:
        return LayerGeometry(alpha, v, z, W, block_size=8, modified=modified)

    (fi, fo), (pi, po) = _both(monkeypatch, make)
    for t in [*fi.values(), *fo.values(), *pi.values(), *po.values()]:
        assert t.triu(1).eq(0).all()
    assert fi["factor_cos"][:, :, 4].isnan().any()


def test_kernel_is_built_once_through_a_rename_and_reused(kernel, fresh_load, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MECHGEOM_CACHE", str(tmp_path))
    lib = build.load("mechgeom._kernels", "contribution_rows.c")
    assert (
        lib is not None
        and hasattr(lib, "mg_contribution_rows_f32")
        and hasattr(lib, "mg_contribution_rows_f64")
    )
    built = sorted(p.name for p in (tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].startswith("contribution_rows-") and built[0].endswith(".so")
    build.load.cache_clear()  # a new process: the library is found, not built again
    monkeypatch.setattr(build, "_build", lambda *a: pytest.fail("built twice"))
    assert build.load("mechgeom._kernels", "contribution_rows.c") is not None


def test_the_kernel_runs_on_pytorchs_own_openmp_runtime(kernel) -> None:
    """Where PyTorch runs on GNU OpenMP, the kernel is built with it and binds to PyTorch's libgomp: no second
    runtime (and no second thread pool) is loaded."""
    if not build.torch_libgomp():
        pytest.skip("PyTorch does not run on GNU OpenMP here: the kernel is built without OpenMP")
    lib = build.load("mechgeom._kernels", "contribution_rows.c")
    assert lib is not None and build.openmp(lib)
    gomp = [p for p in build._mapped_files() if Path(p).name == "libgomp.so.1"]
    assert len(gomp) == 1, gomp


def test_the_source_builds_under_another_name(kernel, tmp_path) -> None:
    """The C file includes itself by name, so a copy under another name (as a package in a zip gives it)
    builds only because the build names its copy after the file."""
    source = tmp_path / "tmp1234-extracted.c"
    source.write_bytes((Path(fused.__file__).parent / "contribution_rows.c").read_bytes())
    cc = build._compiler()
    assert cc is not None
    flags = build.FLAG_SETS[-1]
    assert build._build(cc, source, tmp_path / "a.so", flags, "contribution_rows.c")
    assert not build._build(cc, source, tmp_path / "b.so", flags)  # under its own name the include fails
    assert (tmp_path / "a.so").exists() and not (tmp_path / "b.so").exists()


def test_without_a_compiler_or_when_turned_off_the_plain_sweep_runs(
    fresh_load, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("MECHGEOM_CACHE", str(tmp_path))
    alpha, v, z, W = _layer(1, 2, 9, 3, 5, causal=True, dtype=torch.float64, seed=6)
    ref = brute_force(alpha, v, W)

    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(build, "_compiler", lambda: str(broken))
    assert build.load("mechgeom._kernels", "contribution_rows.c") is None  # every flag set fails
    assert not any(Path(tmp_path / "native").glob("*")), "a failed build leaves no file behind"
    assert not fused.available(alpha)
    assert_all_metrics_match(*LayerGeometry(alpha, v, z, W).compute(), ref, atol=1e-9)

    build.load.cache_clear()
    monkeypatch.setattr(build, "_compiler", lambda: None)
    assert build.load("mechgeom._kernels", "contribution_rows.c") is None

    build.load.cache_clear()
    monkeypatch.undo()
    monkeypatch.setenv("MECHGEOM_NATIVE", "0")
    assert build.disabled() and build.load("mechgeom._kernels", "contribution_rows.c") is None
    assert not fused.available(alpha)
    assert not fused.available(alpha.to(torch.float16))  # turned off: not for any dtype


def test_the_modified_check_runs_only_where_another_hook_could_have_changed_the_layer(monkeypatch) -> None:
    model = make_tiny(n_layers=2, n_kv=2, seed=11)
    tokens = random_tokens(batch=2, pos=9, seed=12)
    calls: list[int] = []
    real = readers.modified_mask
    monkeypatch.setattr(readers, "modified_mask", lambda *a, **k: calls.append(1) or real(*a, **k))

    alone = contribution_weights(model, tokens)
    assert calls == [] and not alone.modified.any()  # only the readers' hooks: z is alpha @ v

    def look(z, hook):  # reads, changes nothing
        return None

    watched = contribution_weights(model, tokens, extra_hooks=[("blocks.1.attn.hook_z", look)])
    assert len(calls) == 1 and not watched.modified.any()  # layer 1 checked, layer 0 not
    for name in INTRA_METRICS:
        torch.testing.assert_close(watched.intra[name], alone.intra[name], equal_nan=True)

    def zero_head(z, hook):  # [batch pos head d_head]: head 2 removed
        z[:, :, 2] = 0
        return z

    calls.clear()
    removed = contribution_weights(model, tokens, extra_hooks=[("blocks.0.attn.hook_z", zero_head)])
    assert len(calls) == 1 and removed.modified[:, 0, 2].all() and not removed.modified[:, 1].any()

    model.train()  # dropout may act after hook_pattern: the check runs
    calls.clear()
    contribution_weights(model, tokens)
    model.eval()
    assert len(calls) == 2
