"""Test helper: the one error line a `paraflex COMMAND` printed on stderr."""


def error_line(capsys, command: str) -> str:
    """The one `paraflex COMMAND: error: ...` line on stderr (warnings may precede it), without
    its prefix; fails the test on a traceback or on more than one error line."""
    err = capsys.readouterr().err
    prefix = f"paraflex {command}: error: "
    errors = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0].removeprefix(prefix)
