"""Test helper: `paraflex serve` in a subprocess, and reading its output lines (not bench/serve_process.py,
whose name it must not take: bench scripts import that one as a top-level module too)."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
import time


@contextlib.contextmanager
def serving(args: list[str], env: dict | None = None):
    """`paraflex serve ARGS` in a subprocess (environment `env`, default this one's): (process,
    queue of its output lines); killed on the way out if the test left it running."""
    proc = subprocess.Popen([sys.executable, "-m", "paraflex", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_until(lines: "queue.Queue[str]", needle: str, timeout: float) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=0.2))
        except queue.Empty:
            continue
        if needle in seen[-1]:
            return seen
    raise AssertionError(f"{needle!r} not printed within {timeout} s; output: {seen}")


def served_url(lines: "queue.Queue[str]", timeout: float = 120) -> str:
    """The API base URL (`http://HOST:PORT/v1`) `paraflex serve` prints once it serves."""
    out = read_until(lines, "/v1", timeout)
    return next(line for line in out if "/v1" in line).split()[0]
