"""A non-editable install carries what a first run needs: the wheel built from this tree,
installed into an empty folder, plans the shipped demo config from another working directory."""

import importlib.util
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
from repo_paths import REPO

BUILD_BACKEND_HERE = int(version("setuptools").split(".")[0]) >= 68 and importlib.util.find_spec("wheel") is not None


@pytest.mark.slow
@pytest.mark.skipif(not BUILD_BACKEND_HERE, reason="the build-system requirements are not installed here "
                    "(pip install 'setuptools>=68' wheel): the wheel is built with --no-build-isolation")
def test_wheel_install_plans_the_shipped_demo(tmp_path):
    wheels, target, cwd = tmp_path / "wheels", tmp_path / "target", tmp_path / "cwd"
    cwd.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(REPO)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = wheels.glob("paraflex-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    assert (target / "paraflex" / "configs" / "demo.yaml").is_file()
    shipped = target / "paraflex" / "data"
    assert (shipped / "traces" / "splitwise_conv.csv").is_file() and (shipped / "profiles" / "LICENSE").is_file()
    assert len(list((shipped / "profiles" / "compute").glob("*/*/*/mlp.csv"))) == 10
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONNOUSERSITE": "1"}
    run = subprocess.run([sys.executable, "-s", "-m", "paraflex", "plan", "-q"], cwd=cwd, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (cwd / "placement.json").is_file()
    check = subprocess.run([sys.executable, "-c", "import paraflex; print(paraflex.__file__)"], cwd=cwd, env=env,
                           capture_output=True, text=True)
    assert check.stdout.startswith(str(target))
