"""`cadence serve` in a process of its own for the tests that drive it over HTTP (test_serve*, test_app_remote)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from bench.servers import STOPS_WITH_PARENT

LOAD_S = 900  # models convert, calibrate and load on first use: minutes on a busy 2-core machine


def status(url: str, data: bytes | None = None, headers: dict | None = None) -> int:
    """The HTTP status a request gets (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def start_server(tmp_path_factory, key: str, *flags: str, data=None):
    """`cadence serve --port 0` with its own data folder (``data``, or a new one) and API key, once /health says its
    models are loaded: (process, base URL, the lines of its stderr so far and to come)."""
    env = dict(os.environ, CADENCE_DATA_DIR=str(data or tmp_path_factory.mktemp("serve-data")))
    # (stopped by Linux when the test process dies, even killed from outside: its teardown would not run)
    proc = subprocess.Popen([sys.executable, "-c", STOPS_WITH_PARENT, sys.executable, "-m", "app.cli", "serve",
                             "--port", "0", "--api-key", key, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        url = None
        while url is None:
            line = proc.stderr.readline()
            if not line:
                raise AssertionError(f"the server ended before it listened: {''.join(lines)}")
            lines.append(line)
            found = re.search(r"at (http://[\d.]+:\d+)/v1", line)
            url = found.group(1) if found else None
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()
        deadline = time.monotonic() + LOAD_S
        while status(url + "/health") != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.5)
    except BaseException:  # a server that never got ready is not left running (it holds gigabytes)
        proc.kill()
        proc.wait(30)
        raise
    return proc, url, lines


def stop_server(proc, lines: list[str]) -> None:
    """Stop it (if it still runs) and check no traceback ever reached its output."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)
    assert "Traceback" not in "".join(lines)
