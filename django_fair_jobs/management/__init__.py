"""The management commands, and what they share."""

from __future__ import annotations


def command_user() -> str:
    """The login name of whoever runs a command, for the history; empty when the system has
    none (some containers), and the history then says only "command"."""
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # getpass raises OSError or KeyError when no name is found
        return ""
