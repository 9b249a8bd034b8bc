"""The OpenMP wait policy of engine processes (paraflex/engine/kernels/omp_policy.py): PASSIVE
unless set, set only before torch loads, and in time in `paraflex serve` (its command line loads
no torch before the command runs)."""

from __future__ import annotations

import os
import subprocess
import sys

from paraflex.engine.kernels import omp_policy

PROBE = ("import os, sys; from paraflex.engine.kernels import omp_policy; applied = omp_policy.apply_here(); "
         "import torch; print(applied, os.environ.get('OMP_WAIT_POLICY'))")


def _child(env_policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_a_fresh_process_gets_passive_and_a_policy_set_by_the_user_is_kept():
    assert _child(None) == "True PASSIVE"
    assert _child("ACTIVE") == "True ACTIVE"


def test_too_late_once_torch_is_loaded_and_nothing_is_set(monkeypatch):
    import torch  # noqa: F401 - loaded, as in this test process

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert omp_policy.apply_here() is False
    assert "OMP_WAIT_POLICY" not in os.environ
    assert omp_policy.engine_wait_policy() == "PASSIVE"  # what a Ray engine actor still gets


def test_the_command_line_loads_no_torch_before_serve_sets_the_policy():
    code = "import sys; from paraflex.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


RUN_COMMAND = ("import os, sys, argparse; from paraflex.commands import {name}; from paraflex.errors import UserError\n"
               "try: {name}.run(argparse.Namespace(**{args!r}))\n"
               "except UserError: pass\n"
               "print(os.environ.get('OMP_WAIT_POLICY'))")


def test_generate_and_profile_set_the_policy_before_anything_else(tmp_path):
    """Both commands run engines in their own process: they set the policy as their first step
    (here each stops at once, on a config file that does not exist)."""
    missing = str(tmp_path / "missing.yaml")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for name, args in (("generate", {"config": missing, "model": "m"}),
                       ("profile", {"config": missing, "repeats": 1})):
        out = subprocess.run([sys.executable, "-c", RUN_COMMAND.format(name=name, args=args)], env=env,
                             capture_output=True, text=True, check=True, timeout=120)
        assert out.stdout.strip() == "PASSIVE", (name, out.stderr)
