"""The one exception type that the command line turns into a one-line error."""


class PitoolsError(Exception):
    """A user-facing failure: bad input, missing file, unsupported model.

    The message is printed as one line (``pitools: error: <message>``) and the
    process exits with status 1. It should name the file or object at fault and
    say what is wrong with it.
    """
