"""The table of contribution metrics (:mod:`mechgeom.analyses.contribution.metrics`): what is derived from it,
the C kernel's slots checked against it, and a new metric added as one row plus one formula."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import make_tiny, random_tokens
from reference_contribution import acts_of, brute_force

from mechgeom._kernels import fused
from mechgeom.analyses import contribution
from mechgeom.analyses.contribution import geometry, metrics, weights
from mechgeom.analyses.contribution.metrics import (
    INTER_METRICS,
    INTRA_METRICS,
    METRICS,
    QUANTITIES,
    Metric,
    Quantity,
    lookup,
    plan,
)
from mechgeom.hooks import expand_kv, run_hooks

C_SOURCE = Path(fused.__file__).parent / "contribution_rows.c"


def _layer(seed: int = 0, *, B: int = 2, H: int = 3, Q: int = 9, D: int = 4, M: int = 6):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, H, Q, Q, generator=g, dtype=torch.float64)
    alpha = scores.masked_fill(torch.ones(Q, Q, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    v = torch.randn(B, Q, H, D, generator=g, dtype=torch.float64)
    z = torch.einsum("bhqk,bkhd->bqhd", alpha, v)
    W = torch.randn(H, D, M, generator=g, dtype=torch.float64) / M**0.5
    return alpha, v, z, W


# --------------------------------------------------------------------------- the table and what it derives


def test_public_names_are_read_off_the_table() -> None:
    """The names and order of the public tuples are those of 0.x (faithfulness rankings and the report use
    them), and every module hands out the same objects."""
    assert INTRA_METRICS == (
        "attention",
        "value_weighted",
        "value_weighted_normalized",
        "contribution",
        "head_share",
        "factor_norm_ratio",
        "factor_cos",
    )
    assert INTER_METRICS == ("attention", "value_weighted", "value_weighted_normalized", "contribution")
    assert tuple(m.name for m in METRICS) == INTRA_METRICS + INTER_METRICS
    for mod in (geometry, weights, contribution):
        assert mod.INTRA_METRICS is INTRA_METRICS and mod.INTER_METRICS is INTER_METRICS
    assert contribution.METRICS is METRICS and contribution.QUANTITIES is QUANTITIES
    assert [m.key for m in METRICS if m.scope == "inter"] == [f"{n}_inter" for n in INTER_METRICS]


def test_every_need_is_declared_and_comes_first() -> None:
    """A need is a quantity or another metric's key; a quantity's needs come before it in QUANTITIES; the
    closure of a metric lists each metric once, after what it needs; unknown names are refused by name."""
    keys = {m.key for m in METRICS}
    order = list(QUANTITIES)
    for name, q in QUANTITIES.items():
        assert q.name == name and q.axis in ("query", "key")
        assert all(order.index(n) < order.index(name) for n in q.needs), name
    for m in METRICS:
        assert m.scope in ("intra", "inter") and m.doc
        assert all(n in QUANTITIES or n in keys for n in m.needs), m.key
        quantities, steps = plan([m.key])
        done: set[str] = {q.name for q in quantities}
        for step in steps:
            assert set(step.needs) <= done, step.key
            done.add(step.key)
        assert len(steps) == len({s.key for s in steps})
        assert (m.formula is None) == (m.key not in done)
    # the closure of contribution, by hand: its own formula, ratio, cosine, normalised value weight
    quantities, steps = plan(["contribution"])
    assert [s.key for s in steps][-1] == "contribution"
    assert {s.key for s in steps} == {
        "contribution",
        "value_weighted_normalized",
        "factor_norm_ratio",
        "factor_cos",
    }
    assert {q.name for q in quantities} == {
        "vt_norm",
        "inv_head_norm",
        "values",
        "unit_values",
        "unit_head_u",
    }
    with pytest.raises(ValueError, match=r"no intra metric 'nope'; valid: \['attention'"):
        lookup("nope", "intra")
    with pytest.raises(ValueError, match="no contribution metric 'nope'"):
        plan(["contribution", "nope"])


def test_a_circle_of_needs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    a = Metric("a", "intra", ("b",), lambda b, out: b.alpha, "a")
    b = Metric("b", "intra", ("a",), lambda b, out: b.alpha, "b")
    monkeypatch.setattr(metrics, "METRICS", (*METRICS, a, b))
    with pytest.raises(ValueError, match="circle: a -> b -> a"):
        plan(["a"])


def test_an_unknown_metric_is_refused_by_layer_geometry() -> None:
    geo = geometry.LayerGeometry(*_layer())
    with pytest.raises(ValueError, match="no inter metric 'head_share'"):
        geo.compute([], ["head_share"])
    with pytest.raises(ValueError, match="no intra metric 'cos'"):
        geo.intra("cos")


# --------------------------------------------------------------------------- the C kernel against the table


def _c_slots(source: str) -> tuple[list[str], list[str], list[str]]:
    """``(slots, intra outputs, inter outputs)`` as the comment above ``mg_contribution_rows`` lists them."""
    text = source[source.index("Slots (") : source.index("Row i gets")]
    slots: list[str] = []
    for number, name in re.findall(r"(?<![\w.\[])(\d+) ([a-z]\w*)", text):
        if int(number) == len(slots):  # numbers of something else ("0 where ...") are skipped
            slots.append(name)
    outputs = text[text.index("outputs") :]
    intra_part, inter_part = outputs.split("[b h q k]")
    intra = re.findall(r"\d+ ([a-z]\w*)", intra_part)
    inter = re.findall(r"\d+ ([a-z]\w*)", inter_part.split("[b q k]")[0])
    return slots, intra, inter


def check_kernel(source: str, slots: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """The C source, ``fused.SLOTS`` and ``fused.OUTPUTS`` agree with each other and with the table."""
    c_slots, c_intra, c_inter = _c_slots(source)
    assert tuple(c_slots) == slots, f"contribution_rows.c lists the slots {c_slots}, fused.SLOTS is {slots}"
    n_slots = int(re.search(r"#define N_SLOTS (\d+)", source).group(1))  # type: ignore[union-attr]
    assert n_slots == len(slots), f"N_SLOTS is {n_slots} in contribution_rows.c, fused.SLOTS has {len(slots)}"
    assert slots[len(slots) - len(outputs) :] == outputs, "fused.OUTPUTS must be the last slots"
    # every output is a row of the table with a formula, in the scope the kernel writes it in
    rows = {m.key: m for m in metrics.METRICS}
    for key in outputs:
        assert key in rows, f"fused.OUTPUTS has {key!r}, which is no row of metrics.METRICS"
        row = rows[key]
        assert row.formula is not None, key
        assert key in (c_intra if row.scope == "intra" else c_inter), (
            f"{key} is {row.scope}-head in the table"
        )
    # the code's slot numbers: intra outputs (temporary rows tmp[s] -> slot first + s), then the inter ones
    first, inter = slots.index(c_intra[0]), slots.index(c_inter[0])
    for snippet in (
        f"p_[{first} + s]",
        f"for (int s = 0; s < {len(c_intra)}; s++) /* the rows",
        f"for (int s = {first}; s < {inter}; s++)",
        f"p_[{inter} + s]",
        f"for (int s = 0; s < {len(c_inter)}; s++)",
    ):
        assert snippet in source, f"contribution_rows.c has no {snippet!r}: its slot numbers moved"
    short = {
        "vw": "value_weighted",
        "vwn": "value_weighted_normalized",
        "c": "contribution",
        "r": "factor_norm_ratio",
        "cos": "factor_cos",
        "sh": "head_share",
    }
    temporaries = dict(re.findall(r"\*restrict o_(\w+) = tmp\[(\d)\]", source))
    in_code = {short[k]: first + int(i) for k, i in temporaries.items()}
    assert in_code == {n: slots.index(n) for n in c_intra}, f"the row pass writes the slots {in_code}"


def test_kernel_slots_agree_with_the_c_source_and_the_table() -> None:
    check_kernel(C_SOURCE.read_text(), fused.SLOTS, fused.OUTPUTS)
    assert fused.SLOTS == fused.INPUTS + fused.OUTPUTS


@pytest.mark.parametrize(
    "change",
    ["swap two outputs", "rename a row", "one slot fewer in C", "move a C temporary"],
)
def test_a_disagreement_between_kernel_and_table_fails(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is not vacuous: each way the three can drift apart fails it."""
    source, slots, outputs = C_SOURCE.read_text(), fused.SLOTS, fused.OUTPUTS
    if change == "swap two outputs":
        outputs = (outputs[1], outputs[0], *outputs[2:])
        slots = fused.INPUTS + outputs
    elif change == "rename a row":
        row = lookup("factor_cos")
        renamed = Metric("factor_cosine", row.scope, row.needs, row.formula, row.doc, row.factor)
        monkeypatch.setattr(metrics, "METRICS", tuple(renamed if m is row else m for m in METRICS))
    elif change == "one slot fewer in C":
        source = source.replace("#define N_SLOTS 19", "#define N_SLOTS 18")
    else:
        source = source.replace("o_c = tmp[2]", "o_c = tmp[3]").replace("o_r = tmp[3]", "o_r = tmp[2]")
    with pytest.raises(AssertionError):
        check_kernel(source, slots, outputs)


# --------------------------------------------------------------------------- the plain sweep reads the table


def test_plain_sweep_prepares_each_quantity_once_and_each_metric_once_per_block(monkeypatch) -> None:
    monkeypatch.setattr(fused, "available", lambda pattern: False)
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)

        return wrapper

    monkeypatch.setattr(
        metrics,
        "QUANTITIES",
        {n: Quantity(q.name, q.axis, q.needs, counted(n, q.prepare), q.doc) for n, q in QUANTITIES.items()},
    )
    monkeypatch.setattr(
        metrics,
        "METRICS",
        tuple(
            m
            if m.formula is None
            else Metric(m.name, m.scope, m.needs, counted(m.key, m.formula), m.doc, m.factor)
            for m in METRICS
        ),
    )
    alpha, v, z, W = _layer(Q=9)
    geometry.LayerGeometry(alpha, v, z, W, block_size=4).compute()  # 3 blocks
    assert {n: calls[n] for n in QUANTITIES} == dict.fromkeys(QUANTITIES, 1)
    assert {m.key: calls[m.key] for m in METRICS if m.formula} == {m.key: 3 for m in METRICS if m.formula}
    calls.clear()
    geometry.LayerGeometry(alpha, v, z, W, block_size=4).compute(["value_weighted"], [])
    assert calls == {"vt_norm": 1, "value_weighted": 3}


@pytest.mark.parametrize("modified", [False, True])
def test_each_metric_alone_is_the_same_on_both_sweeps(sweep_path: str, modified: bool) -> None:
    """Each metric computed alone (the fused sweep then builds only the inputs its closure needs) equals the
    brute force, with modified heads against the family computed together."""
    alpha, v, z, W = _layer(4)
    ref = brute_force(alpha, v, W)
    mod = torch.rand(alpha.shape[:3], generator=torch.Generator().manual_seed(5)) < 0.3 if modified else None
    family = geometry.LayerGeometry(alpha, v, z, W, modified=mod, block_size=4).compute()
    for scope, names in (("intra", INTRA_METRICS), ("inter", INTER_METRICS)):
        for name in names:
            geo = geometry.LayerGeometry(alpha, v, z, W, modified=mod, block_size=4)
            got = geo.intra(name) if scope == "intra" else geo.inter(name)
            want = family[0 if scope == "intra" else 1][name]
            torch.testing.assert_close(
                got, want, atol=1e-12, rtol=1e-12, equal_nan=True, msg=f"{scope} {name}"
            )
            if mod is None:
                torch.testing.assert_close(got, ref[f"{scope}_{name}"], atol=1e-9, rtol=1e-9, equal_nan=True)


# --------------------------------------------------------------------------- a new metric: one row, one formula


def _value_weighted_again(b, out):
    """``alpha[h,i,j] ‖vt[j,h]‖``: value_weighted under another name."""
    return torch.mul(b.alpha, b["vt_norm"], out=out)


def _largest_head_share(b, out):
    """``max_h c[h→i,j]``: the largest head's share of the layer output, from another metric of the block."""
    return torch.amax(b["head_share"], dim=1, out=out)


NEW_ROWS = (
    Metric("value_weighted_again", "intra", ("vt_norm",), _value_weighted_again, "alpha ‖vt‖, again"),
    Metric("largest_head_share", "inter", ("head_share",), _largest_head_share, "max_h head_share"),
)


def test_a_new_metric_is_one_row_and_one_formula(sweep_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows added to the table (one reads a quantity, one reads a metric the kernel has) are computed by the
    collector, on the plain sweep also where the fused one runs the rest, and equal the brute force."""
    monkeypatch.setattr(metrics, "METRICS", (*METRICS, *NEW_ROWS))
    # what the table derives at import (the collector checks names against these)
    monkeypatch.setattr(weights, "INTRA_METRICS", (*INTRA_METRICS, "value_weighted_again"))
    monkeypatch.setattr(weights, "INTER_METRICS", (*INTER_METRICS, "largest_head_share"))
    model = make_tiny(n_kv=2, seed=3)
    tokens = random_tokens(batch=2, pos=10, seed=4)
    col = weights.ContributionCollector(
        model,
        intra=["value_weighted_again", "contribution"],
        inter=["largest_head_share", "value_weighted"],
    )
    run_hooks(model, tokens, col.fwd_hooks)
    res = col.result(tokens)
    _, cache = model.run_with_cache(tokens)
    for li, layer in enumerate(res.layers):
        alpha, v, _ = acts_of(cache, layer)
        ref = brute_force(alpha, v, model.W_O[layer])
        got = {
            "intra_value_weighted": res.intra["value_weighted_again"],
            "intra_contribution": res.intra["contribution"],
            "inter_value_weighted": res.inter["value_weighted"],
        }
        for name, t in got.items():
            torch.testing.assert_close(t[:, li].double(), ref[name], atol=1e-5, rtol=1e-5, msg=name)
        largest = res.inter["largest_head_share"][:, li].double()
        torch.testing.assert_close(largest, ref["intra_head_share"].amax(1), atol=1e-5, rtol=1e-5)
    # the same numbers as the row it copies, through LayerGeometry too (the copy on the plain sweep)
    alpha, v, z = acts_of(cache, 1)
    geo = geometry.LayerGeometry(alpha, expand_kv(v, model.cfg.n_heads), z, model.W_O[1].detach())
    torch.testing.assert_close(geo.intra("value_weighted_again"), geo.value_weighted(), atol=1e-6, rtol=1e-6)


def test_a_formula_that_reads_an_undeclared_need_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "available", lambda pattern: False)
    row = Metric("sloppy", "intra", (), _value_weighted_again, "needs not declared")
    monkeypatch.setattr(metrics, "METRICS", (*METRICS, row))
    with pytest.raises(KeyError, match=r"'vt_norm'.*list it in its row's needs"):
        geometry.LayerGeometry(*_layer()).intra("sloppy")
