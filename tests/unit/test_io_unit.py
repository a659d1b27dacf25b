"""Atomic writes: all or nothing, with the permissions a plain open() would give."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from mechgeom._io import atomic_write, read_frame, write_frame


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "t.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target) as f:
        f.write("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_permissions_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "a.txt") as f:
            f.write("x")
        plain = tmp_path / "b.txt"
        plain.write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_frames_round_trip(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("pyarrow") if suffix == ".parquet" else None
    df = pd.DataFrame({"a": [1, 2], "b": [0.5, -1.0], "c": ["x", "y"]})
    pd.testing.assert_frame_equal(read_frame(write_frame(df, tmp_path / f"t{suffix}")), df)
    with pytest.raises(ValueError, match="csv"):
        write_frame(df, tmp_path / "t.xlsx")
