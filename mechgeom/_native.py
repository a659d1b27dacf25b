"""Small C kernels (private), built on first use with the system C compiler and loaded with :mod:`ctypes`.

A kernel is one C file shipped in the package. :func:`load` compiles it once per machine into
``cache_dir()/native/<name>-<key>.so`` (``cc -O3 -march=native``, through a temporary file and a rename, so
concurrent processes never see half a library) and returns the loaded library, or ``None`` when there is no
compiler, the build fails, or ``MECHGEOM_NATIVE=0`` is set. Callers then take their plain-torch path, which
computes the same numbers. The key hashes the source, the compiler and its version, the flags and the CPU
(its model and feature flags), so a cache shared between different machines never loads code built for
another CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["disabled", "load"]

logger = logging.getLogger(__name__)

#: Tried in order: the first set is for the machine it runs on; the second drops ``-march=native``.
FLAG_SETS = (
    ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC"),
    ("-O3", "-fno-math-errno", "-shared", "-fPIC"),
)


def disabled() -> bool:
    """Whether ``MECHGEOM_NATIVE`` turns the kernels off (``0``, ``false``, ``no`` or ``off``)."""
    return os.environ.get("MECHGEOM_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_id() -> str:
    """The CPU's model and feature flags (Linux ``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep))) or f"{platform.machine()} {platform.processor()}"


def _build(cc: str, source: Path, target: Path, flags: tuple[str, ...]) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120, check=False
        )
        if run.returncode != 0:
            logger.debug("building %s with %s failed:\n%s", source.name, " ".join(flags), run.stderr)
            return False
        os.replace(tmp, target)
        return True
    except (OSError, subprocess.SubprocessError) as err:
        logger.debug("building %s failed: %s", source.name, err)
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load(package: str, filename: str) -> ctypes.CDLL | None:
    """The C file ``filename`` of ``package``, compiled and loaded (cached per process and per machine).

    ``None`` when the kernels are :func:`disabled`, there is no C compiler, or no flag set builds it.
    """
    if disabled():
        return None
    cc = _compiler()
    if cc is None:
        logger.debug("no C compiler found; %s falls back to plain torch", filename)
        return None
    from mechgeom._model_cache import cache_dir

    with resources.as_file(resources.files(package) / filename) as source:
        code = source.read_bytes()
        try:
            version = subprocess.run(
                [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for flags in FLAG_SETS:
            key = hashlib.sha256(
                b"\0".join(
                    [code, cc.encode(), version.encode(), " ".join(flags).encode(), _cpu_id().encode()]
                )
            ).hexdigest()[:16]
            target = cache_dir() / "native" / f"{Path(filename).stem}-{key}.so"
            if target.exists() or _build(cc, source, target, flags):
                try:
                    return ctypes.CDLL(str(target))
                except OSError as err:
                    logger.debug("loading %s failed: %s", target, err)
    return None
