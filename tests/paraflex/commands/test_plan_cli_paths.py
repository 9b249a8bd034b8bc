"""`paraflex plan` output paths: a bad -o / --png / --validate path is a one-line exit-2 error
naming the flag and the fix (not a traceback from the write); --png prints the file it wrote."""

import pytest
import yaml

from cli_errors import error_line
from paraflex.cli import main
from paraflex.placement import Placement

CONFIG = {
    "cluster": {"num_engines": 2, "device": "cpu", "memory_gb": 1, "host_memory_gb": 0.01},
    "models": [{"name": "a", "arch": "tiny-2l"}, {"name": "b", "arch": "tiny-4l"}],
    "scheduler": {"max_batch_size": 8, "block_bytes": 4096},
    "workload": {"arrival": "poisson", "num_requests": 30, "seed": 0},
}


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp_path / "o").mkdir()
    (tmp_path / "afile").write_text("")
    return "c.yaml"


@pytest.mark.parametrize("output, expected", [
    ("o", "-o: o is a directory; pass a file name, e.g. -o o/placement.json"),
    ("", "-o: empty file name; pass a file, e.g. -o placement.json"),
    ("afile/x.json", "-o: afile is not a directory; pass a file in an existing directory"),
    ("nodir/x.json", "-o: nodir does not exist; pass a file in an existing directory"),
], ids=["directory", "empty", "under-a-file", "missing-folder"])
def test_bad_output_path_is_a_user_error(cfg, capsys, output, expected):
    assert main(["plan", cfg, "-q", "-o", output]) == 2
    assert expected in error_line(capsys, "plan")


def test_unwritable_output_is_a_user_error(cfg, capsys, monkeypatch):
    def refuse(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Placement, "save", refuse)
    assert main(["plan", cfg, "-q", "-o", "p.json"]) == 2
    assert "-o: cannot write p.json (Permission denied); pass another file" in error_line(capsys, "plan")


@pytest.mark.parametrize("png, expected", [
    ("afile/x.png", "--png: afile is not a directory"),
    ("o/pl.txt", "--png: o/pl.txt: matplotlib cannot draw .txt files; end the name in .png"),
], ids=["under-a-file", "unknown-format"])
def test_bad_png_path_is_a_user_error(cfg, tmp_path, capsys, png, expected):
    assert main(["plan", cfg, "-q", "-o", "p.json", "--png", png]) == 2
    assert expected in error_line(capsys, "plan")
    assert not (tmp_path / "p.json").exists()  # refused before planning


def test_png_without_suffix_reports_the_file_written(cfg, tmp_path, capsys):
    assert main(["plan", cfg, "-o", "p.json", "--png", "o"]) == 0
    assert "wrote p.json and o.png in" in capsys.readouterr().out
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


def test_validate_a_directory_is_a_user_error(cfg, capsys):
    assert main(["plan", cfg, "--validate", "o"]) == 2
    assert error_line(capsys, "plan").endswith("o is a directory; pass a placement JSON file")
