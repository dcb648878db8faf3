"""What counts as the user's mistake, and the one wrapper that turns it into exit code 2.

A user error (a path, a config value, a file the user named, a full disk) prints
one paragraph on stderr and exits with code 2; anything else is a bug and keeps
its traceback. The library raises its own error classes; only `user_errors`
knows about click.
"""

from __future__ import annotations

import errno
import functools
import sys

import click

from buffer.layout import StorageError


class UserError(click.ClickException):
    """Bad input from the user: message on stderr, exit code 2, no traceback."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"asyncgrpo: error: {self.format_message()}", err=True)


class RunError(Exception):
    """The run cannot start or continue; the message says why and what to do."""


class AblateError(Exception):
    """Bad ablation input (a value, a path), or a cell that failed; the message names it."""


class DataError(Exception):
    """Bad input to a command that turns a run's rollouts into something new (export, rescore): a
    path, an option's value, a filter; the message names it."""


# The library's user-facing errors, by module: a class whose module was never imported cannot
# have been raised, so looking them up in sys.modules keeps a user error from importing torch.
USER_ERRORS = [("buffer.layout", "BufferError"), ("pipeline.errors", "RunError"),
               ("pipeline.errors", "AblateError"), ("pipeline.errors", "DataError"),
               ("workers.checks", "ConfigError"),
               ("workers.model", "ModelError"), ("workers.tasks", "TaskError"),
               ("workers.trainer.session", "TrainerError"), ("workers.warmstart", "WarmstartError")]

# Disk full, file-size limit, quota, read-only filesystem, no permission: the machine, not a bug.
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def user_error_types() -> tuple[type[Exception], ...]:
    """The classes of USER_ERRORS whose modules are loaded."""
    return tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules)


def environment_message(e: OSError) -> str:
    """One paragraph for an OSError raised below the library's own checks (e.g. a lock file)."""
    return str(e if isinstance(e, StorageError) else StorageError(e.filename or "a file", e))


def user_errors(fn):
    """Decorate a command: the library's user errors and environment OSErrors become UserError."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except user_error_types() as e:
            raise UserError(str(e)) from None
        except OSError as e:
            if e.errno not in ENVIRONMENT_ERRNOS:
                raise
            raise UserError(environment_message(e)) from None
    return wrapper
