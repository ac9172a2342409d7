"""The one exception type that means "the user asked for something we cannot do".

The CLI prints a `UserError` as a single line and exits with status 2; anything else is
a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user: the message names the problem and the fix."""
