"""scripts/trim_notebooks.py: what the stored tutorials keep and drop."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("trim_notebooks", ROOT / "scripts" / "trim_notebooks.py")
assert spec is not None and spec.loader is not None
trim_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trim_notebooks)


def _nb(extra_html: str = "") -> dict:
    live = {
        "output_type": "display_data",
        "metadata": {},
        "data": {
            "text/html": ["<div>", "var CircuitsVis=(()=>{})();" + extra_html],
            "text/plain": ["<View>"],
        },
    }
    png = {
        "output_type": "display_data",
        "metadata": {},
        "data": {"image/png": "iVBORw0KGgo=", "text/plain": ["<Image>"]},
    }
    table = {
        "output_type": "execute_result",
        "execution_count": 2,
        "metadata": {},
        "data": {"text/plain": ["   a\n0  1"]},
    }
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {},
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "# t"},
            {
                "cell_type": "code",
                "execution_count": 1,
                "metadata": {"execution": {"iopub.execute_input": "2026-12-04T00:00:00Z"}},
                "source": "viz.show(v)",
                "outputs": [
                    {"output_type": "stream", "name": "stderr", "text": "loading: 1/1 done\r"},
                    {"output_type": "stream", "name": "stdout", "text": "result 3\n"},
                    live,
                    png,
                    table,
                ],
            },
        ],
    }


def test_trim_drops_live_bundles_stderr_and_timings_and_keeps_results() -> None:
    nb = _nb()
    counts = trim_notebooks.trim(nb)
    assert counts == {"live_views": 1, "stderr": 1, "timings": 1}
    outs = nb["cells"][1]["outputs"]
    assert [o.get("name") for o in outs if o["output_type"] == "stream"] == ["stdout"]
    assert "CircuitsVis" not in json.dumps(outs)
    assert outs[1]["data"]["text/html"] == trim_notebooks.LIVE_NOTE
    assert outs[2]["data"]["image/png"] == "iVBORw0KGgo="  # the static picture stays
    assert outs[3]["data"]["text/plain"] == ["   a\n0  1"]  # and the table
    assert "execution" not in nb["cells"][1]["metadata"]
    assert trim_notebooks.trim(nb) == {"live_views": 0, "stderr": 0, "timings": 0}  # idempotent


def test_main_writes_back_and_fails_over_the_size_limit(tmp_path: Path) -> None:
    small, big = tmp_path / "small.ipynb", tmp_path / "big.ipynb"
    small.write_text(json.dumps(_nb()))
    nb = _nb()
    nb["cells"][1]["outputs"].append({"output_type": "stream", "name": "stdout", "text": "x" * 5000})
    big.write_text(json.dumps(nb))
    assert trim_notebooks.main([str(small), "--max-bytes", "4000"]) == 0
    assert "CircuitsVis" not in small.read_text()
    assert trim_notebooks.main([str(small), str(big), "--max-bytes", "4000"]) == 1
    assert "CircuitsVis" not in big.read_text()  # still trimmed and written
