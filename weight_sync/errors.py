"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad input or an unmet precondition; the message names the problem."""
