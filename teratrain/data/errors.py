"""The error bad data input raises (a leaf: every data module imports it)."""


class DataError(ValueError):
    """Bad data input: one sentence naming the problem and the fix."""
