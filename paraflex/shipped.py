"""Files shipped inside the package, found with importlib.resources (so a wheel has them too).

Place in the data flow: the commands ask here for what a user may leave out or name short:
the demo config (`paraflex serve` / `paraflex plan` with no CONFIG; the folder `configs/` of
the repository, installed as the package `paraflex.configs`) and the Splitwise traces
(`paraflex simulate --trace splitwise-conv`; `paraflex/data/traces/`, MIT, processed by Vidur,
licence and attribution beside them), and Vidur's measured A100/H100 operator tables
(`cluster.profile_dir: vidur`; `paraflex/data/profiles/`, MIT, median columns only).
"""

from __future__ import annotations

import os
from importlib.resources import files

from paraflex.errors import UserError

DEMO_CONFIG = "demo.yaml"
TRACES = {"splitwise-conv": "splitwise_conv.csv", "splitwise-code": "splitwise_code.csv"}
SHIPPED_PROFILES = "vidur"  # the `cluster.profile_dir` value that names the shipped tables


def config_path(name: str = DEMO_CONFIG) -> str:
    """The file path of the shipped config `name` (it may be missing from a broken install)."""
    return os.fspath(files("paraflex.configs") / name)


def demo_config_path() -> str:
    """The shipped demo config, a UserError when the installation lacks it."""
    path = config_path(DEMO_CONFIG)
    if not os.path.isfile(path):
        raise UserError(f"CONFIG: no config given and the demo config {path} is missing; "
                        "pass a config file, e.g. `paraflex serve my-cluster.yaml`")
    return path


def trace_path(name_or_path: str) -> str:
    """The CSV a `--trace` value names: a shipped trace by its short name, else the path as given."""
    if name_or_path in TRACES:
        return os.fspath(files("paraflex") / "data" / "traces" / TRACES[name_or_path])
    return name_or_path


def profiles_path() -> str:
    """The folder of the shipped profile tables (`cluster.profile_dir: vidur`)."""
    return os.fspath(files("paraflex") / "data" / "profiles")
