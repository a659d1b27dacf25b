"""The report and a circuitsvis view render offline in headless Chromium.

Chromium is driven through the DevTools protocol over ``--remote-debugging-pipe`` (file descriptors 3
and 4, NUL-separated JSON; no websocket library needed). For each page the test enables the Network,
Runtime, Log and Page domains, loads the file, and asserts:

- **mounted**: every circuitsvis placeholder ``div#circuits-vis-*`` holds elements that React rendered
  (descendants other than the inline ``<script>``), checked with ``Runtime.evaluate``;
- **no console errors**: no ``Runtime.consoleAPICalled`` of type error/assert, no
  ``Runtime.exceptionThrown``, no ``Log.entryAdded`` at level error;
- **no network**: every ``Network.requestWillBeSent`` URL is ``file:``, ``data:``, ``blob:`` or
  ``about:`` (the browser also runs with ``--host-resolver-rules=MAP * ~NOTFOUND``, so a request that
  slipped through could not reach anything, but it would still be recorded and fail the test).

A full-page screenshot goes to ``results/report/`` for a look by eye. Without Chromium the test is
skipped with the install command; in CI (``CI`` set) a missing Chromium is a failure.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "results" / "report"
INSTALL = "bash .ci/install_chromium.sh  (apt-get install -y --no-install-recommends chromium)"
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--remote-debugging-pipe",
    "--window-size=1200,900",
]

MOUNT_CHECK = """(() => {
  const views = Array.from(document.querySelectorAll('div[id^="circuits-vis-"]'));
  const mounted = views.filter(v => v.querySelectorAll(':scope *:not(script)').length > 0);
  return JSON.stringify({
    bundle: typeof window.CircuitsVis,
    views: views.length,
    mounted: mounted.length,
    rendered: mounted.map(v => v.querySelectorAll(':scope *:not(script)').length),
    images: Array.from(document.images).map(i => [i.complete, i.naturalWidth]),
  });
})()"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail(f"chromium is missing in CI; .ci/run must run: {INSTALL}")
    pytest.skip(f"chromium is not installed; run: {INSTALL}")


class DevTools:
    """A minimal DevTools-protocol client over ``--remote-debugging-pipe``."""

    def __init__(self, exe: str, user_data_dir: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self._log = open(Path(user_data_dir) / "chrome.log", "wb")  # noqa: SIM115 - closed in close()
        # bash moves our pipe ends onto the fds Chromium expects: 3 (commands in), 4 (messages out).
        self.proc = subprocess.Popen(
            [
                "bash",
                "-c",
                'exec "$@" 3<&"$CDP_IN" 4>&"$CDP_OUT"',
                "bash",
                exe,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={user_data_dir}",
                "about:blank",
            ],
            env={**os.environ, "CDP_IN": str(to_chrome_r), "CDP_OUT": str(from_chrome_w)},
            pass_fds=(to_chrome_r, from_chrome_w),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                break
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            for raw in msgs:
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()
                else:
                    self.events.put(msg)
        with self._cond:
            self._cond.notify_all()

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session: str | None = None,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._next_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"no reply to {method} (chromium exit code {self.proc.poll()})")
                self._cond.wait(left)
            reply = self._replies.pop(self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def close(self) -> None:
        try:
            os.write(self._to_chrome, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        self._log.close()


def render_page(path: Path, screenshot: Path, *, settle_s: float = 3.0) -> dict[str, Any]:
    """Load ``path`` in headless Chromium; return the mount check, requests, console errors; save a screenshot."""
    exe = _chromium()
    with tempfile.TemporaryDirectory(prefix="mechgeom-chromium-") as profile:
        cdp = DevTools(exe, profile)
        try:
            target = cdp.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Network", "Runtime", "Log"):
                cdp.send(f"{domain}.enable", session=session)
            cdp.send("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
            events: list[dict[str, Any]] = []
            deadline = time.monotonic() + 90
            loaded_at = None
            while time.monotonic() < deadline:
                try:
                    ev = cdp.events.get(timeout=0.2)
                    events.append(ev)
                    if ev.get("method") == "Page.loadEventFired" and loaded_at is None:
                        loaded_at = time.monotonic()
                except queue.Empty:
                    pass
                if loaded_at is not None and time.monotonic() - loaded_at > settle_s:
                    break
            assert loaded_at is not None, f"{path} never fired the load event"
            check = json.loads(
                cdp.send(
                    "Runtime.evaluate", {"expression": MOUNT_CHECK, "returnByValue": True}, session=session
                )["result"]["value"]
            )
            metrics = cdp.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
            height = min(int(metrics["height"]) + 1, 12000)
            cdp.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": 1200, "height": height, "deviceScaleFactor": 1, "mobile": False},
                session=session,
            )
            time.sleep(0.5)
            shot = cdp.send("Page.captureScreenshot", {"format": "png"}, session=session, timeout=120)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
            while not cdp.events.empty():
                events.append(cdp.events.get())
        finally:
            cdp.close()
    requests = [
        e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"
    ]
    errors = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            errors.append(json.dumps(p.get("exceptionDetails", {}))[:500])
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            errors.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
    return {"check": check, "requests": requests, "errors": errors, "events": len(events)}


def _assert_offline_render(page: dict[str, Any], *, min_views: int, global_bundle: bool) -> None:
    check = page["check"]
    if global_bundle:  # mechgeom's pages load the bundle once as a classic script (a global CircuitsVis)
        assert check["bundle"] == "object", "window.CircuitsVis is not defined: the bundle did not run"
    assert check["views"] >= min_views
    assert check["mounted"] == check["views"], f"unmounted circuitsvis views: {check}"
    assert min(check["rendered"]) >= 5, f"views rendered almost nothing: {check['rendered']}"
    assert page["errors"] == [], f"console errors: {page['errors']}"
    outside = [u for u in page["requests"] if not u.startswith(LOCAL_SCHEMES)]
    assert outside == [], f"requests left the page: {outside}"
    assert page["requests"], "the Network domain recorded nothing (not even the page itself)"


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The session's --quick report, shared with test_report_smollm2.py (built once, by whichever runs first).
    from test_report_smollm2 import quick_report_dir

    return quick_report_dir(tmp_path_factory) / "report.html"


@pytest.mark.slow  # needs the session's quick report (one to two minutes)
def test_report_renders_offline_in_chromium(quick_report: Path) -> None:
    page = render_page(quick_report, SHOTS / "report_quick_chromium.png")
    _assert_offline_render(page, min_views=1, global_bundle=True)
    imgs = page["check"]["images"]
    assert imgs and all(ok and width > 0 for ok, width in imgs), f"figures did not decode: {imgs}"


def test_viz_html_renders_offline_in_chromium(tmp_path: Path) -> None:
    # A page of several views written by mechgeom.viz.save_html: the bundle once, as a classic script in the
    # head (a global CircuitsVis), then each panel's div and module-script render call.
    from conftest import make_tiny, random_tokens

    from mechgeom import contribution_weights, viz

    res = contribution_weights(make_tiny(n_kv=2), random_tokens(1, 9), layers=[1])
    views = [viz.head_view(res, 1, 2), viz.layer_view(res, 1), viz.token_view(res, 1, query=8, head=2)]
    path = viz.save_html(views, tmp_path / "v.html")
    assert path.read_text(encoding="utf-8").count("var CircuitsVis=") == 1
    page = render_page(path, SHOTS / "viz_view_chromium.png")
    _assert_offline_render(page, min_views=3, global_bundle=True)
    assert page["check"]["views"] == 3


def test_viz_repr_html_renders_offline_in_chromium(tmp_path: Path) -> None:
    # What Jupyter shows for one View (View._repr_html_): each panel self-contained, its own bundle in its
    # module script (so no global CircuitsVis).
    from conftest import make_tiny, random_tokens

    from mechgeom import contribution_weights, viz

    res = contribution_weights(make_tiny(n_kv=2), random_tokens(1, 9), layers=[1])
    path = tmp_path / "repr.html"
    path.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>"
        + viz.head_view(res, 1, 0)._repr_html_()
        + "</body></html>",
        encoding="utf-8",
    )
    page = render_page(path, tmp_path / "repr.png")
    _assert_offline_render(page, min_views=1, global_bundle=False)


def test_smollm2_head_html_renders_offline_in_chromium(smollm2: Any, tmp_path: Path) -> None:
    # The HTML a user saves for a real SmolLM2 head: attention beside contribution weights, plus the signed
    # contributions of each source to one query.
    from mechgeom import contribution_weights, viz

    res = contribution_weights(smollm2, "The cat sat on the mat because it was tired.", layers=[5])
    last = res.tokens.shape[1] - 1
    path = viz.save_html(
        [viz.head_view(res, 5, 0), viz.token_view(res, 5, query=last, head=0)], tmp_path / "head_L5H0.html"
    )
    page = render_page(path, SHOTS / "smollm2_head_L5H0_chromium.png")
    _assert_offline_render(page, min_views=2, global_bundle=True)


def test_render_page_detects_a_network_request_and_an_error(tmp_path: Path) -> None:
    # The checks above can fail: a page that fetches from the network and logs an error is caught.
    path = tmp_path / "bad.html"
    path.write_text(
        "<!DOCTYPE html><html><head><script src='https://unpkg.com/x.js'></script></head><body>"
        "<div id='circuits-vis-x'></div><script>console.error('boom')</script></body></html>"
    )
    page = render_page(path, tmp_path / "bad.png", settle_s=1.0)
    assert any(u.startswith("https://unpkg.com/") for u in page["requests"])
    assert any("boom" in e for e in page["errors"])
    assert page["check"]["mounted"] == 0 and page["check"]["views"] == 1


def test_viz_snapshot_draws_the_view_as_a_png(tmp_path: Path) -> None:
    # mechgeom.viz.snapshot (the static picture the tutorials store under each live view): a real PNG of the
    # rendered view, cropped below its content, whose pixels hold the view's blue and red weights.
    import io

    from conftest import make_tiny, random_tokens
    from PIL import Image

    from mechgeom import contribution_weights, viz
    from mechgeom.viz.static import chromium

    _chromium()  # skip without Chromium (a failure in CI)
    assert chromium() is not None
    res = contribution_weights(make_tiny(n_kv=2), random_tokens(1, 9), layers=[1])
    view = viz.token_view(res, 1, query=8, head=2)
    path = viz.snapshot(view, tmp_path / "token.png", width=800, height=3000)
    img = Image.open(io.BytesIO(path.read_bytes())).convert("RGB")
    assert img.width == 800 and 40 < img.height < 3000  # cropped well below the 3000 px window
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None
    blue = sum(n for n, (r, g, b) in colours if b > r + 60)  # the positive weights' cells
    assert blue > 100, "no blue cells: the view did not render"
    assert not list(tmp_path.glob(".*.tmp")), "the PNG is written through a temporary file"


def test_viz_snapshot_fails_clearly_without_chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import make_tiny, random_tokens

    from mechgeom import contribution_weights, viz
    from mechgeom.viz import static

    monkeypatch.delenv("MECHGEOM_CHROMIUM", raising=False)
    monkeypatch.setattr(static.shutil, "which", lambda name: None)
    res = contribution_weights(make_tiny(n_kv=2), random_tokens(1, 5), layers=[0])
    with pytest.raises(RuntimeError, match="install it"):
        viz.snapshot(viz.head_view(res, 0, 0), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
