"""User-facing errors: one line saying what went wrong, where, and how to fix it."""


class UserError(Exception):
    """An error a person can fix; the CLI prints its one line and exits 2."""

    exit_code = 2


class ConfigError(UserError):
    """The configuration file is missing, unreadable or invalid."""


class StoreError(UserError):
    """The state store cannot be opened or is not an eagle3 store."""


class StageError(UserError):
    """A stage cannot be started, stopped or read as asked."""
