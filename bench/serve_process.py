"""`paraflex serve` in a subprocess, for the benchmarks that load a running server
(bench/serve_load.py, bench/soak.py): started on a free port, its URL read from its stdout,
stopped the way Ctrl-C stops it.

bench/ is no package: the scripts put their own folder on sys.path to import this module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time


class ServeProcess:
    """`paraflex serve CONFIG --port 0` (in-process engines, or Ray engine actors). `threads`
    sets the in-process engines' torch threads (Ray gives each engine actor the threads of its
    CPU share instead); `echo` prints the server's start-up lines; `extra_args` go to `serve`
    (e.g. --placement FILE, --request-log FILE); `launcher` replaces `python -m paraflex` (e.g.
    `python -c CODE`, CODE running paraflex.cli.main on sys.argv[1:] after setting something up);
    `log_path` keeps what the server prints after its URL (warnings, its shutdown lines)."""

    def __init__(self, config: str, *, backend: str = "in-process", threads: int | None = None,
                 max_outstanding: int = 4096, echo: bool = False, who: str = "bench",
                 extra_args: tuple[str, ...] = (), launcher: tuple[str, ...] = (), log_path: str | None = None) -> None:
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        cmd = [*(launcher or (sys.executable, "-m", "paraflex")), "serve", config, "--port", "0",
               "--max-outstanding", str(max_outstanding), *extra_args] + (["--in-process"] if backend == "in-process" else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.url = None
        deadline = time.monotonic() + 600
        for line in self.proc.stdout:
            if echo:
                print(f"  [serve] {line.rstrip()}", flush=True)
            match = re.search(r"(http://\S+)/v1", line)
            if match:
                self.url = match.group(1)
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.stop()
            raise SystemExit(f"{who}: the server did not print its URL" + ("; see its output above" if echo else ""))
        self.reader = threading.Thread(target=self._keep_output, args=(log_path,), daemon=True)
        self.reader.start()  # a full pipe would block the server

    def _keep_output(self, log_path: str | None) -> None:
        if log_path is None:
            self.proc.stdout.read()
            return
        with open(log_path, "w") as fh:
            for line in self.proc.stdout:
                fh.write(line)
                fh.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: the same clean shutdown as Ctrl-C
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        reader = getattr(self, "reader", None)  # (none yet when the server never printed its URL)
        if reader is not None:
            reader.join(5)  # the log holds the server's last lines
