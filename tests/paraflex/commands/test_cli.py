"""The CLI frame: help, exit codes."""

import subprocess
import sys

from paraflex.cli import main


def test_help_lists_subcommands(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "paraflex" in out


def test_no_subcommand_exits_2():
    assert main([]) == 2


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "paraflex", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "paraflex" in proc.stdout


def test_misspelled_flag_of_a_subcommand_shows_its_usage_and_the_closest_flag(capsys):
    try:
        main(["plan", "--sovler", "milp"])
    except SystemExit as exc:
        assert exc.code == 2
    err = capsys.readouterr().err
    assert "usage: paraflex plan" in err
    assert "unrecognized arguments: --sovler (did you mean --solver?)" in err
