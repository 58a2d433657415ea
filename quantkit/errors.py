"""User-facing errors.

Anything raised as `QuantkitError` reaches the user as one line on stderr and a
non-zero exit (see `quantkit.cli`). Internal bugs stay ordinary exceptions.
"""


class QuantkitError(Exception):
    """A problem with the user's input or environment, reported as one line."""
