"""Joining an existing Ray cluster (`paraflex serve --ray-address HOST:PORT`), with the reason
and the fix when it cannot.

Place in the data flow: `paraflex.serving.ray_startup.start_cluster` calls `join_ray` before it
creates any engine actor. Two failures are common and Ray reports neither plainly: nothing
listens at the address (Ray then retries for minutes and exits the process), and the cluster
uses token authentication while this process does not send the token (Ray >= 2.5x turns token
authentication on for a head started where a token exists, e.g. ~/.ray/auth_token; a process
joining an explicit address only sends it with RAY_AUTH_MODE=token; Ray retries ~20 s, then
raises `ConnectionError`). A TCP probe of the address catches the first at once; the second is
turned into one line naming RAY_AUTH_MODE and the token. docs/cluster.md has the set-up.
"""

from __future__ import annotations

import os
import socket

import ray

from paraflex.errors import UserError

PROBE_TIMEOUT_S = 5.0
DOCS = "docs/cluster.md"


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT) of a Ray head's GCS; UserError naming the form otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head (the address "
                        f"`ray start --head` prints, e.g. 10.0.0.1:6379) or 'auto'; see {DOCS}")
    return host, int(port)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """UserError unless something accepts TCP connections at `address`."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
    raise UserError(f"--ray-address {address}: nothing answers there ({why}); start the head there with "
                    f"`ray start --head --port={port}`, open the port, or fix the address; see {DOCS}")


def auth_hint() -> str:
    """What to change when the head refuses this process (token authentication)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ("the cluster most likely uses token authentication and this process sends no token: "
                "set RAY_AUTH_MODE=token and make the head's token (`ray get-auth-token` on the head) "
                "available here as ~/.ray/auth_token or RAY_AUTH_TOKEN")
    return ("RAY_AUTH_MODE=token is set, so the token was refused or the head is not a Ray head: "
            "the token here (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) must equal "
            "`ray get-auth-token` on the head")


def join_ray(address: str) -> None:
    """`ray.init(address=...)`, or a UserError with the reason and the fix."""
    if address != "auto":
        probe(address)
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, SystemExit) as exc:  # Ray exits the process when the GCS never answers
        fix = "start one on this machine with `ray start --head`" if address == "auto" else auth_hint()
        raise UserError(f"--ray-address {address}: cannot join the Ray cluster ({type(exc).__name__}: {exc}); "
                        f"{fix}; see {DOCS}") from None
