"""Small C kernels (private), built on first use with the system C compiler and loaded with :mod:`ctypes`.

A kernel is one C file shipped in the package. :func:`load` compiles it once per machine into
``cache_dir()/native/<name>-<key>.so`` (``cc -O3 -march=native``, through a temporary file and a rename, so
concurrent processes never see half a library) and returns the loaded library, or ``None`` when there is no
compiler, the build fails, or ``MECHGEOM_NATIVE=0`` is set. Callers then take their plain-torch path, which
computes the same numbers. The key hashes the source, the compiler and its version, the flags and the CPU
(its model and feature flags), so a cache shared between different machines never loads code built for
another CPU.

**Threads.** Where PyTorch runs its CPU operators on GNU OpenMP (``libgomp.so.1``, as the Linux wheels do)
and that runtime is already loaded, the kernel is built with ``-fopenmp``: the dynamic loader binds the
library's ``libgomp.so.1`` to the one in memory, so its ``omp parallel`` regions run on PyTorch's own thread
pool (the threads that just ran a matmul pick the work up; no second pool competes with them for the cores).
:func:`openmp` says whether a loaded library was built so. Anywhere else it is built without, and runs on the
calling thread.
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

__all__ = ["disabled", "load", "openmp", "torch_libgomp"]

logger = logging.getLogger(__name__)

#: Every build's flags (``-fopenmp-simd``: the ``omp simd`` reductions vectorise without ``-ffast-math``).
BASE_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC")
#: Tried in order: the first set is for the machine it runs on; the second drops ``-march=native``. Where
#: :func:`torch_libgomp` holds, each is first tried with ``-fopenmp`` added.
FLAG_SETS = ((*BASE_FLAGS, "-march=native"), BASE_FLAGS)
_OPENMP: set[str] = set()  # paths of the loaded libraries built with -fopenmp


def _mapped_files() -> list[str]:
    """Paths of the files mapped into this process (Linux ``/proc/self/maps``; empty elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({ln.split(None, 5)[5] for ln in lines if len(ln.split(None, 5)) == 6})


def torch_libgomp() -> bool:
    """Whether PyTorch's CPU operators run on GNU OpenMP and exactly one ``libgomp.so.1`` is loaded (theirs),
    and no other OpenMP runtime (``libiomp5``, LLVM's ``libomp``) is: a library built with ``-fopenmp`` then
    shares PyTorch's thread pool."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    names = [Path(p).name for p in _mapped_files()]
    others = [n for n in names if n.startswith(("libiomp5", "libomp.so", "libomp-"))]
    return names.count("libgomp.so.1") == 1 and not others


def openmp(lib: ctypes.CDLL) -> bool:
    """Whether ``lib`` (from :func:`load`) was built with ``-fopenmp`` on PyTorch's OpenMP runtime."""
    return str(lib._name) in _OPENMP


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


def _build(cc: str, source: Path, target: Path, flags: tuple[str, ...], name: str | None = None) -> bool:
    """Compile ``source`` into ``target`` through a temporary file and a rename. The source is compiled from a
    copy named ``name`` (default: its own name) in a folder of its own: a file may include itself by name, and
    a package read from a zip gives a temporary file under another name."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix="mechgeom-build-") as folder:
            copy = Path(folder) / (name or source.name)
            copy.write_bytes(source.read_bytes())
            run = subprocess.run(
                [cc, *flags, "-o", tmp, str(copy)], capture_output=True, text=True, timeout=120, check=False
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
    from mechgeom.models.cache import cache_dir

    with resources.as_file(resources.files(package) / filename) as source:
        code = source.read_bytes()
        try:
            version = subprocess.run(
                [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        with_omp = torch_libgomp()
        sets = [g for f in FLAG_SETS for g in (((*f, "-fopenmp"), f) if with_omp else (f,))]
        for flags in sets:
            key = hashlib.sha256(
                b"\0".join(
                    [code, cc.encode(), version.encode(), " ".join(flags).encode(), _cpu_id().encode()]
                )
            ).hexdigest()[:16]
            target = cache_dir() / "native" / f"{Path(filename).stem}-{key}.so"
            if target.exists() or _build(cc, source, target, flags, filename):
                try:
                    lib = ctypes.CDLL(str(target))
                except OSError as err:
                    logger.debug("loading %s failed: %s", target, err)
                    continue
                if "-fopenmp" in flags:
                    if torch_libgomp():
                        _OPENMP.add(str(lib._name))
                    else:  # it brought an OpenMP runtime of its own: never start a second thread pool
                        logger.warning(
                            "%s loaded a second OpenMP runtime; its kernels run on one thread", filename
                        )
                return lib
    return None
