"""User-facing errors: one clear line naming the file/field and the fix, exit code 2."""

from __future__ import annotations


class UserError(Exception):
    """An error the user caused (bad file, flag, config or data row).

    The CLI prints `error: <message>` on one line and exits with code 2, never a traceback.
    The message should name the file and/or field and say what to do.
    """

    exit_code = 2
