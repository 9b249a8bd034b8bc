"""Running the gateway app under uvicorn: in the foreground (`paraflex serve`) or on a thread.

Data flow: `paraflex serve` builds a Backend, wraps it with app.build_app, binds a socket
(port 0 picks a free port, so the real URL is known before serving) and calls `serve`,
which ends after Ctrl-C / SIGTERM once uvicorn has drained connections (KeyboardInterrupt /
SystemExit, so the engines are stopped either way). A SIGTERM first opens a drain window
(`--drain-seconds`): /health answers 503 and new requests 503 with Retry-After while running
ones go on, so that a load balancer stops sending before the listener closes. Tests and the
load benchmark use `ServerThread` to run the same app on a background thread and stop it
by handle.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import signal
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from paraflex.errors import UserError
from paraflex.gateway.read_timeouts import BodyReadTimeout, HeaderTimeoutH11


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = any free port). A failure is a UserError
    naming --port when the port is the cause (taken, or privileged) and --host otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = None
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if sock is not None:
            sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            raise UserError(f"--port: cannot listen on {host}:{port} ({exc.strerror}); pick another port "
                            "or 0 for any free one") from None
        raise UserError(f"--host: cannot listen on {host}:{port} ({exc.strerror}); pick an address of this "
                        "machine (127.0.0.1, 0.0.0.0 for all)") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server, remembering the shutdown signals its handlers caught, draining on the
    first SIGTERM for `drain_s` seconds before it shuts down (the gateway stops admitting; a
    second SIGTERM or a Ctrl-C ends the window), and ending the gateway's running requests
    explicitly when it shuts down (`Gateway.drain`) instead of letting uvicorn cancel them after
    its grace period (which cut streams off mid-chunk)."""

    def __init__(self, config: uvicorn.Config, gateway, drain_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway  # app.state.gateway (None for an app build_app did not make)
        self.drain_s = drain_s
        self.drain_ends: float | None = None  # monotonic time the drain window closes
        self.caught: list[int] = []

    def handle_exit(self, sig: int, frame) -> None:
        self.caught.append(sig)
        if (sig == signal.SIGTERM and self.drain_s > 0 and self.drain_ends is None and not self.should_exit
                and self.gateway is not None):
            self.drain_ends = time.monotonic() + self.drain_s
            self.gateway.stop_admitting()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_ends is not None and time.monotonic() >= self.drain_ends:
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        try:
            if self.gateway is not None:
                await self.gateway.drain()
        finally:
            try:
                await super().shutdown(sockets)
            finally:
                if self.gateway is not None:  # after the connections: no request waits on a worker
                    await asyncio.to_thread(self.gateway.body_workers.close)


# How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals the idle
# expiry of httpx's connection pool (and so the OpenAI client's): the server closed connections
# just as clients reused them, and ~1 request in 2,500-10,000 got a connection reset before
# any status line. 75 s is nginx's and gunicorn's default, far above the clients' 5 s.
KEEP_ALIVE_S = 75
READ_TIMEOUT_S = 30.0  # default header and body read timeout (read_timeouts.py; `--read-timeout`)
DRAIN_S = 5.0  # `paraflex serve`'s default drain window after SIGTERM (`--drain-seconds`)


def server_config(app: FastAPI, read_timeout: float = READ_TIMEOUT_S) -> uvicorn.Config:
    """uvicorn's settings for the gateway: the app behind the body read timeout, the h11
    protocol with the header read timeout, and the keep-alive above."""
    protocol = functools.partial(HeaderTimeoutH11, header_timeout=read_timeout)
    return uvicorn.Config(BodyReadTimeout(app, read_timeout), http=protocol, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S, lifespan="off")


def _server(app: FastAPI, read_timeout: float, drain_s: float) -> _Server:
    return _Server(server_config(app, read_timeout), getattr(app.state, "gateway", None), drain_s)


def serve(app: FastAPI, sock: socket.socket, announce=None, read_timeout: float = READ_TIMEOUT_S,
          drain_s: float = DRAIN_S) -> None:
    """Serve until SIGINT/SIGTERM (after SIGTERM's drain window of `drain_s` seconds; uvicorn's
    handlers then drain the connections), then raise
    KeyboardInterrupt after a Ctrl-C (the CLI exits 130) or SystemExit(143) after SIGTERM, so
    the caller's clean-up (stopping the engines) runs either way. `announce()` (printing the
    URL) runs once SIGTERM is caught here, so a process manager that acts on the URL cannot kill
    the process before its clean-up: until uvicorn installs its own handler, a SIGTERM goes to
    uvicorn's exit handler, which ends the server as soon as it starts; uvicorn re-raises the
    signal it caught into the handler that was there before it (this one again). A re-raised
    SIGINT becomes a cancellation in asyncio's runner, lost when its main task has already
    finished, so the interrupt is raised here instead."""
    server = _server(app, read_timeout, drain_s)
    if server.gateway is not None:  # before any request can wait on the fork (body_workers.py)
        server.gateway.body_workers.start_processes()
    previous = signal.signal(signal.SIGTERM, server.handle_exit)
    try:
        if announce is not None:
            announce()
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if signal.SIGINT in server.caught:
        raise KeyboardInterrupt
    if signal.SIGTERM in server.caught:
        raise SystemExit(128 + signal.SIGTERM)


class ServerThread:
    """The app on a daemon thread (uvicorn leaves signals alone off the main thread);
    `stop()` shuts uvicorn down at once and joins the thread; `terminate()` does what a SIGTERM
    does to `serve` (a drain window of `drain_s` seconds first, none by default)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, read_timeout: float = READ_TIMEOUT_S,
                 drain_s: float = 0.0):
        self._sock = bind(host, port)
        self.url = base_url(self._sock)
        self._server = _server(app, read_timeout, drain_s)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="paraflex-gateway", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        return self

    def terminate(self) -> None:
        """What SIGTERM does: open the drain window (or, during one, shut down now)."""
        self._server.handle_exit(signal.SIGTERM, None)

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
