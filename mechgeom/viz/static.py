"""Static PNG pictures of circuitsvis views, taken with headless Chromium, for pages that run no JavaScript.

A circuitsvis view is a React component: GitHub's notebook renderer, a PDF export or a plain-text log show
nothing of it. :func:`snapshot` writes the view with :func:`~mechgeom.viz.views.save_html` (offline: the
bundle inlined, never a CDN), loads that file in headless Chromium with the network mapped to nowhere, and
saves the rendered page as a PNG cropped to its content. :func:`show` displays, in Jupyter, the live view
followed by that picture.

Chromium is optional: :func:`chromium` finds it (``$MECHGEOM_CHROMIUM``, then ``chromium``,
``chromium-browser``, ``google-chrome`` on ``PATH``); :func:`snapshot` raises a ``RuntimeError`` that says
how to install it, and :func:`show` says in a line that the picture was skipped.

>>> from mechgeom.viz.static import chromium
>>> chromium() is None or isinstance(chromium(), str)
True
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mechgeom._io import atomic_write
from mechgeom.viz.views import View, save_html

__all__ = ["chromium", "show", "snapshot"]

INSTALL_HINT = (
    "apt-get install -y --no-install-recommends chromium (or set MECHGEOM_CHROMIUM to a Chrome binary)"
)

_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-extensions",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # the page is offline; nothing could be fetched anyway
)


def chromium() -> str | None:
    """The Chromium (or Chrome) executable to use, or None when there is none."""
    env = os.environ.get("MECHGEOM_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _crop(png: bytes, margin: int = 12) -> bytes:
    """Cut the white rows below the page's content (the window is taller than most views)."""
    from PIL import Image, ImageChops

    img = Image.open(io.BytesIO(png)).convert("RGB")
    box = ImageChops.difference(img, Image.new("RGB", img.size, "white")).getbbox()
    if box is None:
        raise RuntimeError("the screenshot is blank: the view did not render")
    bottom = min(img.height, box[3] + margin)
    out = io.BytesIO()
    img.crop((0, 0, img.width, bottom)).save(out, format="PNG", optimize=True)
    return out.getvalue()


def snapshot(
    view: View | Sequence[View],
    path: str | Path,
    *,
    width: int = 1000,
    height: int = 4000,
    wait_ms: int = 5000,
    timeout_s: float = 120.0,
) -> Path:
    """Render ``view`` in headless Chromium and write a PNG of it to ``path`` (atomically).

    The window is ``width × height`` CSS pixels; the picture is cropped below the content. ``wait_ms`` is
    Chromium's virtual-time budget for the page's scripts (React mounts well within it). Raises
    ``RuntimeError`` when Chromium is missing, fails, or draws a blank page.
    """
    exe = chromium()
    if exe is None:
        raise RuntimeError(
            f"headless Chromium is needed for a static picture of a view; install it: {INSTALL_HINT}"
        )
    with tempfile.TemporaryDirectory(prefix="mechgeom-snapshot-") as tmp:
        page = save_html(view, Path(tmp) / "view.html")
        shot = Path(tmp) / "view.png"
        cmd = [
            exe,
            *_FLAGS,
            f"--user-data-dir={Path(tmp) / 'profile'}",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={shot}",
            page.resolve().as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
        if done.returncode != 0 or not shot.is_file():
            tail = done.stderr.decode(errors="replace")[-800:]
            raise RuntimeError(f"Chromium failed to take the picture (exit {done.returncode}): {tail}")
        png = _crop(shot.read_bytes())
    with atomic_write(path, "wb") as f:
        f.write(png)
    return Path(path)


def show(view: View, *, width: int = 1000) -> None:
    """In Jupyter: display the live circuitsvis ``view`` and, under it, a static PNG of the same view.

    The PNG is what a reader sees where JavaScript does not run (GitHub, an exported page). Without
    Chromium the picture is skipped with a one-line note; the live view is shown either way.
    """
    from IPython.display import HTML, Image, display

    display(view)
    if chromium() is None:
        display(
            HTML(f"<p><i>No static picture: headless Chromium is not installed ({INSTALL_HINT}).</i></p>")
        )
        return
    with tempfile.TemporaryDirectory(prefix="mechgeom-show-") as tmp:
        png = snapshot(view, Path(tmp) / "view.png", width=width).read_bytes()
    display(Image(data=png, format="png", width=min(width, 900)))
