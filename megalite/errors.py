"""The base class of every error caused by input the user can fix.

Each subclass's message names the flag (or file) and the fix. Entry points
catch ``MegaliteError`` and print the message on one line instead of a
traceback; anything else is a bug and keeps its traceback.
"""


class MegaliteError(Exception):
    """Bad flags, sizes, files or checkpoints; the message says what to change."""
