"""The one exception type for bad user input.

`InputError` is a problem with what the user gave us (a flag, a data file, a checkpoint, a
prompt), never a bug. Entry points report it as one line `error: <what>; <the fix>` with a
non-zero exit and no traceback; any other exception keeps its traceback, because it is ours.
"""


class InputError(ValueError):
    """A bad flag, file or checkpoint; the message names it and says how to fix it."""
