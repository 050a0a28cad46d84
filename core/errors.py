"""The one error a user can act on, shared by every package (it lives in the lowest layer that
raises one). Every CLI-facing error class derives from :class:`UserError`; ``mixfleet.cli``
prints one as a single line (``mixfleet COMMAND: error: MESSAGE``) and exits 2."""


class UserError(Exception):
    """Bad input or an unmet precondition; the message names the problem."""
