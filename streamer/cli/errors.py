"""The one error the command line raises for a problem the user can fix."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""
