"""Error types shared by every ParaFlex component.

The CLI (`paraflex.cli`) maps them to exit codes: a `UserError` (bad config, bad flag,
missing file) prints one line and exits 2; any other `ParaflexError` exits 1.
"""


class ParaflexError(Exception):
    """An internal failure that is not the user's fault (exit status 1)."""

    exit_code = 1


class UserError(ParaflexError):
    """Bad input from the user: the message names the problem and the fix (exit status 2)."""

    exit_code = 2


class ConfigError(UserError):
    """A config value is wrong; `path` names the field, e.g. ``models[2].rate``."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)

    def __reduce__(self):  # (a sweep's worker process sends it back pickled)
        return type(self), (self.path, self.reason)
