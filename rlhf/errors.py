"""User-facing errors: one clear line naming the file/field and the fix, exit code 2."""

from __future__ import annotations

import os


class UserError(Exception):
    """An error the user caused (bad file, flag, config or data row).

    The CLI prints `error: <message>` on one line and exits with code 2, never a traceback.
    The message should name the file and/or field and say what to do.
    """

    exit_code = 2


def debug_enabled() -> bool:
    """RLHF_DEBUG=1 (any value but empty or 0): code that turns a user's own exception (a reward
    function that raised) into a one-line UserError re-raises the original instead, traceback and all."""
    return os.environ.get("RLHF_DEBUG", "") not in ("", "0")
