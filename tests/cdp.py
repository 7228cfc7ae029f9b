"""A small Chrome DevTools Protocol client for the tests: headless Chromium driven over a pipe.

Chromium's `--remote-debugging-pipe` speaks CDP as NUL-terminated JSON messages on file descriptors 3 (to
the browser) and 4 (from it), which is how Playwright and Puppeteer drive it too: no websocket, no port,
no dependency. Debian's `chromium` package (installed by `make browser`, a prerequisite of `make test`). A test that needs it
calls `require_chromium()` first: without Chromium it skips, saying why, except under CI (`CI` set and not
false, as CI services set it and .ci/run's environment does), where a browser test that skips would pass
unseen: there it fails, saying to install Chromium.

    with Browser() as b:
        page = b.open("file:///tmp/plan.html")
        page.eval("document.title"); page.click("summary"); page.screenshot("out.png")
        page.errors          # console errors and uncaught exceptions seen so far
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage",
         "--remote-debugging-pipe"]


def chromium() -> str | None:
    """The Chromium executable on PATH, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def in_ci() -> bool:
    """Whether this runs under CI: the environment variable CI set to anything but "", "0", "false" or "no"."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


MISSING = ("Debian's chromium is not installed (no `chromium` or `chromium-browser` on PATH): `make browser` "
           "installs it (apt-get install chromium), as `make test` does")


def require_chromium() -> str:
    """The Chromium executable; without one, skip the calling test with the reason, or under CI fail it."""
    import pytest

    exe = chromium()
    if exe is None:
        if in_ci():
            pytest.fail(f"{MISSING}; under CI (CI={os.environ['CI']!r}) the browser tests must run, not skip: "
                        "install chromium", pytrace=False)
        pytest.skip(MISSING)
    return exe


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless Chromium process with a fresh profile; a context manager that kills it on exit."""

    def __init__(self, timeout: float = 30.0, width: int = 1280, height: int = 900):
        exe = chromium()
        if exe is None:
            raise CDPError("chromium: expected the `chromium` executable on PATH, got none; run `make browser`")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="meshc-chromium-")
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        # the child's ends move above fd 9 first, so that putting them on fds 3 and 4 overwrites neither
        child = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_r, from_w)]
        for fd in (to_r, from_w):
            os.close(fd)
        to_r, from_w = child
        # bash (dash takes one-digit fds only) puts them on fds 3 and 4, where CDP expects them, and execs Chromium
        script = f'exec "$0" "$@" 3<&{to_r} 4>&{from_w}'
        self.proc = subprocess.Popen(["/bin/bash", "-c", script, exe, *FLAGS, f"--user-data-dir={self._profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     pass_fds=(to_r, from_w))
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict] = []

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (CDPError, OSError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_w, self._from_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    # ----------------------------------------------------------------------------------- the wire
    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and wait for its reply; events that arrive meanwhile go to `self.events`."""
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise CDPError(f"chromium: expected a reply within {self.timeout} s, got none "
                               f"(exit code {self.proc.poll()})")
            chunk = os.read(self._from_r, 1 << 16)
            if not chunk:
                raise CDPError("chromium: the DevTools pipe closed")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def wait_event(self, method: str, session: str | None = None) -> dict:
        """Wait for the next event `method` (of `session`), looking first at those already received."""
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method and (session is None or ev.get("sessionId") == session):
                    return self.events.pop(i)
            self.events.append(self._read())

    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log"):
            page.send(f"{domain}.enable")
        page.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired", session)
        return page


class Page:
    """One tab, attached with a flat session."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def eval(self, expression: str):
        """The value of a JavaScript expression (JSON-serialisable), or CDPError with the page's exception."""
        out = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in out:
            raise CDPError(f"evaluate {expression!r}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the centre of the first element matching `selector`."""
        box = self.eval(f"(() => {{ const el = document.querySelector({json.dumps(selector)}); "
                        "el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect(); "
                        "return [r.x + Math.min(r.width / 2, 20), r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def screenshot(self, path, *, full_height: int | None = None, scale: float = 1.0) -> None:
        """Write a PNG of the viewport (or of the top `full_height` CSS pixels of the page), scaled by `scale`."""
        params = {"format": "png"}
        if full_height or scale != 1.0:
            width = self.eval("document.documentElement.clientWidth")
            height = full_height or self.eval("window.innerHeight")
            params.update(clip={"x": 0, "y": 0, "width": width, "height": height, "scale": scale},
                          captureBeyondViewport=True)
        data = self.send("Page.captureScreenshot", params)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    @property
    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries of this page so far."""
        out = []
        for ev in self.browser.events:
            if ev.get("sessionId") != self.session:
                continue
            p = ev.get("params", {})
            if ev.get("method") == "Runtime.exceptionThrown":
                out.append(str(p.get("exceptionDetails", {}).get("exception", {}).get("description")
                               or p.get("exceptionDetails")))
            elif ev.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif ev.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out
