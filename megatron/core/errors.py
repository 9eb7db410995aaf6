"""The one exception type for bad user input.

`InputError` is a problem with what the user gave us (a flag, a data file, a checkpoint, a
prompt), never a bug. Entry points report it as one line `error: <what>; <the fix>` with a
non-zero exit and no traceback; any other exception keeps its traceback, because it is ours.
"""


class InputError(ValueError):
    """A bad flag, file or checkpoint; the message names it and says how to fix it."""


def user_message(error: InputError) -> str:
    """The line to print for `error`. One raised in a DataLoader worker (a sample's token ids checked
    as it is read) reaches the training process with the worker's traceback folded into its text:
    torch re-raises it as `type(error)("Caught ... Original Traceback ...")`, whose last line is
    `<module>.<class>: <the original message>`."""
    text = str(error)
    if not text.startswith("Caught "):
        return text
    marker = f"{type(error).__name__}: "
    last = text.rstrip().splitlines()[-1]
    return last.split(marker, 1)[1] if marker in last else text
