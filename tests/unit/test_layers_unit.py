"""The structure of ``docs/architecture.md``, checked on the source.

- Layers: the shared helpers, models, data, the native kernels and the sweep engine < hooks < analyses < viz <
  report/cli. Every mechgeom module belongs to exactly one layer, and imports only its own layer or those below.
- No import circle between mechgeom modules, counting every import form: ``import a.b``, ``from a import b``
  where ``b`` is a module, ``from a.b import c``, relative imports, imports inside functions and under
  ``TYPE_CHECKING``.
- No module uses another module's ``_private`` name, by ``from m import _x`` or by ``m._x``.
- A function over :data:`MAX_FUNCTION_LINES` lines says why in a comment (``# Why this function is long: ...``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mechgeom

PKG = Path(mechgeom.__file__).parent
#: The lowest layer: shared helpers, backends and data, the native kernels and the sweep engine.
BELOW_HOOKS = {
    "typing",
    "_io",
    "_progress",
    "_batch_queue",
    "_deprecation",
    "_lazy",
    "_kernels",
    "sweep",
    "models",
    "encoder_models",
    "data",
    "maths",
}
PRESENTATION = ("mechgeom.viz", "mechgeom.report", "mechgeom.cli", "mechgeom.__main__")
#: Above the other layers: the package's own ``__init__`` re-exports the public names of every layer.
TOP = {"mechgeom"}
MAX_FUNCTION_LINES = 80
LONG_MARKER = "why this function is long"


def layer_of(module: str) -> str | None:
    """``below``, ``hooks``, ``analyses``, ``presentation`` or ``top`` for a mechgeom module; ``None`` for others."""
    if module in TOP:
        return "top"
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
    return "unknown"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(source: str, name: str = "mechgeom.x", known: set[str] | None = None) -> set[str]:
    """Every module that ``source`` (the module ``name``) imports, in any form and anywhere in the file.

    ``from a import b`` names ``a.b`` where that is a module (``known``), else ``a``; relative imports are
    resolved against ``name`` (a package's ``__init__`` is the package itself).
    """
    known = all_modules().keys() if known is None else known
    is_pkg = name in known and any(k.startswith(name + ".") for k in known)
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            subs = {f"{module}.{alias.name}" for alias in node.names} & set(known)
            out.update(subs)
            if len(subs) < len(node.names):  # some names are the module's own (a package's: its __init__)
                out.add(module)
    return out


def module_imports() -> dict[str, set[str]]:
    mods = all_modules()
    known = set(mods)
    return {name: imports_of(path.read_text(encoding="utf-8"), name, known) for name, path in mods.items()}


def violations(name: str, imported: set[str]) -> list[str]:
    layer = layer_of(name)
    bad = []
    if layer == "unknown":
        bad.append(
            f"{name} belongs to no layer: add it to the layer map of docs/architecture.md and this test"
        )
    for mod in imported:
        target = layer_of(mod)
        if layer in ("below", "hooks", "analyses"):
            if mod.split(".")[0] == "matplotlib":
                bad.append(f"{name} imports {mod} (figures live in mechgeom.viz)")
            if target in ("presentation", "top"):
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
    assert {
        "mechgeom.hooks.readers",
        "mechgeom.analyses.contribution.weights",
        "mechgeom.viz.figures",
        "mechgeom._kernels.fused",
    } <= set(mods)
    assert {layer_of(m) for m in mods} >= {"below", "hooks", "analyses", "presentation"}
    bad = [v for name, imported in mods.items() for v in violations(name, imported)]
    assert not bad, "\n".join(bad)


def test_no_library_module_switches_the_matplotlib_backend() -> None:
    users = [p.name for p in PKG.rglob("*.py") if "matplotlib.use(" in p.read_text(encoding="utf-8")]
    assert not users


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> the modules it imports), or ``None``."""
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*path, m, d]
            if d not in state and (found := visit(d, [*path, m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def dependency_graph() -> dict[str, set[str]]:
    mods = module_imports()
    return {m: {i for i in imp if i in mods and i != m} for m, imp in mods.items()}


def test_no_import_cycle_between_mechgeom_modules() -> None:
    cycle = find_cycle(dependency_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_reads_every_import_form() -> None:
    """The circle of 0.2 (``geometry`` imported ``fused`` as ``from mechgeom.analyses import
    contribution_fused``, which imported ``geometry`` under ``TYPE_CHECKING``) is found in each form."""
    known = {"mechgeom.a", "mechgeom.a.g", "mechgeom.a.f"}
    forms = [
        "from mechgeom.a import f",
        "import mechgeom.a.f",
        "from . import f",
        "from .f import X",
        "def later():\n    from mechgeom.a.f import X\n",
        "if TYPE_CHECKING:\n    from mechgeom.a.f import X\n",
    ]
    back = "from mechgeom.a.g import G\n"
    for form in forms:
        graph = {
            "mechgeom.a.g": imports_of(form, "mechgeom.a.g", known) & known,
            "mechgeom.a.f": imports_of(back, "mechgeom.a.f", known) & known,
        }
        assert find_cycle(graph), form


@pytest.mark.parametrize(
    ("name", "source", "needle"),
    [
        (
            "mechgeom.analyses.sinks.statistics",
            "def f():\n    import matplotlib.pyplot as plt\n",
            "matplotlib.pyplot",
        ),
        ("mechgeom.analyses.heads.pruning", "from mechgeom import report\n", "mechgeom.report"),
        ("mechgeom.analyses.heads.pruning", "import mechgeom\n", "a higher layer"),
        (
            "mechgeom.hooks.interventions",
            "from mechgeom.analyses.contribution.weights import LayerGeometry\n",
            "analysis mechgeom.analyses.contribution.weights",
        ),
        (
            "mechgeom._kernels.fused",
            "from mechgeom.analyses.contribution import geometry\n",
            "analysis mechgeom.analyses.contribution",
        ),
        ("mechgeom.viz.views", "from mechgeom.report import build_report\n", "report composes viz"),
        ("mechgeom.somewhere", "", "belongs to no layer"),
    ],
)
def test_the_checker_catches_each_kind_of_violation(name: str, source: str, needle: str) -> None:
    found = violations(name, imports_of(source, name))
    assert any(needle in v for v in found), found


def private_uses(source: str) -> list[str]:
    """``from mechgeom... import _x`` and ``alias._x`` where ``alias`` names an imported mechgeom module."""
    tree = ast.parse(source)
    bad: list[str] = []
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mechgeom")):
            for a in node.names:
                if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__")):
                    bad.append(f"line {node.lineno}: from {node.module} import {a.name}")
                aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mechgeom"):
                    aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return bad


def test_no_module_uses_another_modules_private_names() -> None:
    """Private modules (``mechgeom._io``, ``mechgeom._kernels``) are the package's own helpers and are imported
    by their public names; a ``_name`` defined in one module is used by that module only."""
    found = {
        name: uses
        for name, path in all_modules().items()
        if (uses := private_uses(path.read_text(encoding="utf-8")))
    }
    assert not found, found


def test_the_private_check_catches_both_forms() -> None:
    assert private_uses("from mechgeom.analyses.faithfulness.rankings import _settings\n")
    assert private_uses("from . import _helper\n")
    assert private_uses("from mechgeom._kernels import build\nbuild._build()\n")
    assert not private_uses("from mechgeom._io import atomic_write\nfrom mechgeom import __version__\n")


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (methods included) longer than ``limit`` lines without a comment saying why.

    The docstring does not count: Args/Returns that explain what and why are asked for, not a cost.
    """
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                n -= (first.end_lineno or first.lineno) - first.lineno + 1
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno]).lower()
            if n > limit and LONG_MARKER not in body:
                out.append(f"{node.name} (line {node.lineno}, {n} lines)")
    return out


def test_no_function_is_over_80_lines_without_saying_why() -> None:
    long = {
        str(p.relative_to(PKG)): f for p in sorted(PKG.rglob("*.py")) if (f := long_functions(p.read_text()))
    }
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines with no '# {LONG_MARKER}: ...' comment: {long}"
    )


def test_the_long_function_check_reads_the_marker() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}")
    assert not long_functions(
        f"def f():\n    # Why this function is long: one loop, read top to bottom.\n{body}"
    )


#: What a presentation module may not import: the report and the run verbs compose analyses' results and
#: draw figures; the numbers come from the analyses.
NUMERIC = ("numpy", "einops", "scipy", "torch.nn")


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
