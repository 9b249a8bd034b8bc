"""`paraflex serve` (and `generate`) refuse, before any engine starts, a --placement that is a
directory or was planned for another config (models or layer counts differ), an
unbindable --host, and a GPU config on a machine that shows no GPU."""

import pytest
import yaml

from cli_errors import error_line
from gateway_cluster import LAYOUT, config_dict, make_placement
from paraflex.cli import main


@pytest.fixture
def placement(tmp_path):
    path = tmp_path / "placement.json"
    make_placement().save(path)
    return str(path)


def _config(tmp_path, **archs) -> str:
    """The gateway test config with some models' architectures replaced (name=arch)."""
    d = config_dict()
    for m in d["models"]:
        m["arch"] = archs.get(m["name"].replace("-", "_"), m["arch"])
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def test_placement_directory_is_a_user_error(tmp_path, capsys):
    (tmp_path / "o").mkdir()
    assert main(["serve", _config(tmp_path), "--placement", str(tmp_path / "o"), "--in-process"]) == 2
    assert error_line(capsys, "serve").endswith("o is a directory; pass a placement JSON file")


def test_placement_with_other_layer_counts_is_refused(tmp_path, placement, capsys):
    assert LAYOUT["tiny-4l"][0] == 4  # the placement cuts tiny-4l's 4 layers; the config has 8
    cfg = _config(tmp_path, tiny_4l="tiny-8l")
    assert main(["serve", cfg, "--placement", placement, "--in-process"]) == 2
    assert (f"{placement}: model tiny-4l: stages cover layers 0-0, 1-3 but its architecture tiny-8l in "
            f"{cfg} has 8 layers (0-7); re-run `paraflex plan {cfg} -o {placement}` for this config") in error_line(capsys, "serve")


def test_placement_with_other_models_is_refused(tmp_path, placement, capsys):
    d = config_dict()
    d["models"] = d["models"][:2]
    cfg = tmp_path / "two.yaml"
    cfg.write_text(yaml.safe_dump(d))
    assert main(["serve", str(cfg), "--placement", placement, "--in-process"]) == 2
    assert (f"places models tiny-2l, tiny-4l, tiny-8l but {cfg} has tiny-2l, tiny-4l; "
            "re-run `paraflex plan") in error_line(capsys, "serve")


def test_unbindable_host_is_named_before_any_planning(tmp_path, placement, capsys):
    # 192.0.2.1 (TEST-NET-1) is reserved for documentation: no interface has it
    assert main(["serve", _config(tmp_path), "--placement", placement, "--in-process",
                 "--host", "192.0.2.1", "--port", "8123"]) == 2
    err = error_line(capsys, "serve")
    assert "--host: cannot listen on 192.0.2.1:8123 (" in err
    assert err.endswith("pick an address of this machine (127.0.0.1, 0.0.0.0 for all)")


def test_generate_checks_its_placement_too(tmp_path, placement, capsys):
    cfg = _config(tmp_path, tiny_4l="tiny-8l")
    assert main(["generate", cfg, "--model", "tiny-2l", "--prompt", "hi", "--placement", placement]) == 2
    assert "model tiny-4l: stages cover layers 0-0, 1-3" in capsys.readouterr().err


def test_a_gpu_config_on_a_machine_without_that_gpu_is_refused(tmp_path, monkeypatch, capsys):
    """Issue 24: a100-80g on a CPU machine tried to allocate ~592 GB of KV in host memory."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = config_dict()
    d["cluster"] = {**d["cluster"], "device": "a100-80g"}
    d["cluster"].pop("memory_gb", None)
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(d))
    assert main(["serve", str(path), "--port", "0", "--in-process"]) == 2
    assert error_line(capsys, "serve").startswith("cluster.device is 'a100-80g' but no CUDA device is present here")
