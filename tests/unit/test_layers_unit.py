"""The layering of ARCHITECTURE.md, checked on the source: each layer imports only the layers below it.

models/data and the shared helpers < hooks < analyses < viz < report/cli. Every import counts, also the ones
inside functions, so a lazy ``import matplotlib.pyplot`` in an analysis fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mechgeom

PKG = Path(mechgeom.__file__).parent
BELOW_HOOKS = {"typing", "_io", "_progress", "_batch_queue", "sweep", "models", "data", "maths"}
PRESENTATION = ("mechgeom.viz", "mechgeom.report", "mechgeom.cli")


def layer_of(module: str) -> str | None:
    """``below``, ``hooks``, ``analyses`` or ``presentation`` for a mechgeom module; ``None`` otherwise."""
    if not module.startswith("mechgeom."):
        return None
    short = module.removeprefix("mechgeom.")
    if short.split(".")[0] in BELOW_HOOKS:
        return "below"
    if short == "hooks" or short.startswith("hooks."):
        return "hooks"
    if short == "analyses" or short.startswith("analyses."):
        return "analyses"
    if module.startswith(PRESENTATION):
        return "presentation"
    return None


def imports_of(source: str) -> set[str]:
    """Every module named by an ``import`` or ``from ... import`` anywhere in ``source`` (relative imports excluded)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            if node.module == "mechgeom":  # from mechgeom import viz
                out.update(f"mechgeom.{alias.name}" for alias in node.names)
    return out


def module_imports() -> dict[str, set[str]]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = imports_of(path.read_text(encoding="utf-8"))
    return mods


def violations(name: str, imported: set[str]) -> list[str]:
    layer = layer_of(name)
    bad = []
    for mod in imported:
        target = layer_of(mod)
        if layer in ("below", "hooks", "analyses"):
            if mod.split(".")[0] == "matplotlib":
                bad.append(f"{name} imports {mod} (figures live in mechgeom.viz)")
            if target == "presentation":
                bad.append(f"{name} imports {mod} (a higher layer)")
        if layer in ("below", "hooks") and target == "analyses":
            bad.append(f"{name} imports the analysis {mod}")
        if layer == "below" and target == "hooks":
            bad.append(f"{name} imports {mod} (hooks sit above it)")
        if name.startswith("mechgeom.viz") and mod.startswith(("mechgeom.report", "mechgeom.cli")):
            bad.append(f"{name} imports {mod} (report composes viz, not the reverse)")
    return bad


def test_every_layer_imports_only_the_layers_below() -> None:
    mods = module_imports()
    assert {"mechgeom.hooks.readers", "mechgeom.analyses.contribution", "mechgeom.viz.figures"} <= set(mods)
    assert {layer_of(m) for m in mods} >= {"below", "hooks", "analyses", "presentation"}
    bad = [v for name, imported in mods.items() for v in violations(name, imported)]
    assert not bad, "\n".join(bad)


def test_no_library_module_switches_the_matplotlib_backend() -> None:
    users = [p.name for p in PKG.rglob("*.py") if "matplotlib.use(" in p.read_text(encoding="utf-8")]
    assert not users


def test_no_import_cycle_between_mechgeom_modules() -> None:
    mods = module_imports()
    graph = {m: {i for i in imp if i in mods and i != m} for m, imp in mods.items()}
    # a package's __init__ re-exports its children: that edge is not a cycle through the layers
    graph = {
        m: {i for i in deps if not (m != "mechgeom" and i.startswith(m + "."))} for m, deps in graph.items()
    }
    graph["mechgeom"] = set()  # the top-level package only re-exports
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path, m, d]))
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize(
    ("name", "source", "needle"),
    [
        ("mechgeom.analyses.sinks", "def f():\n    import matplotlib.pyplot as plt\n", "matplotlib.pyplot"),
        ("mechgeom.analyses.pruning", "from mechgeom import report\n", "mechgeom.report"),
        (
            "mechgeom.hooks.interventions",
            "from mechgeom.analyses.contribution import LayerGeometry\n",
            "analysis mechgeom.analyses.contribution",
        ),
        ("mechgeom.viz.views", "from mechgeom.report import build_report\n", "report composes viz"),
    ],
)
def test_the_checker_catches_each_kind_of_violation(name: str, source: str, needle: str) -> None:
    found = violations(name, imports_of(source))
    assert any(needle in v for v in found), found


MAX_LINES = 600
#: What a presentation module may not import: the report and the run verbs compose analyses' results and
#: draw figures; the numbers come from the analyses.
NUMERIC = ("numpy", "einops", "scipy", "torch.nn")


def test_no_library_file_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(PKG)): n
        for p in sorted(PKG.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_report_imports_no_numeric_library() -> None:
    mods = module_imports()
    bad = {
        name: sorted(m for m in imported if m.split(".")[0] in NUMERIC or m.startswith(NUMERIC))
        for name, imported in mods.items()
        if name.startswith("mechgeom.report")
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_top_level_exports_every_hook_factory_and_entry_point() -> None:
    from mechgeom.hooks import interventions

    factories = {n for n in interventions.__all__ if n.endswith(("_hook", "_hooks"))}
    entry_points = {
        "contribution_weights",
        "contribution_weights_from_cache",
        "contribution_overview",
        "perplexity_curves",
        "task_accuracy_curves",
        "sink_statistics",
        "sink_statistics_from_cache",
        "sink_ablation",
        "convexity_check",
        "token_selection",
        "token_selection_from_cache",
        "classify_heads",
        "classify_heads_from_cache",
        "head_stats",
        "head_stats_from_cache",
        "single_head_sweep",
        "retention_curves",
        "collect",
        "embedding_curves",
        "encoder_sink_statistics",
        "sentence_embedding",
    }
    missing = sorted((factories | entry_points) - set(mechgeom.__all__))
    assert not missing, missing
    assert all(callable(getattr(mechgeom, n)) for n in factories | entry_points)
