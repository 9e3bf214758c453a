"""The exceptions that the command line turns into one-line errors."""

import signal


class PitoolsError(Exception):
    """A user-facing failure: bad input, missing file, unsupported model.

    The message is printed as one line (``pitools: error: <message>``) and the
    process exits with status 1. It should name the file or object at fault and
    say what is wrong with it.
    """


def install_hint(extra: str) -> str:
    """How to install an optional extra (serve, ray, cuda), as the README installs the toolkit: from its checkout."""
    return f"pip install -e '.[{extra}]' in the source checkout"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, as one exception.

    The command line delivers SIGTERM (what ``timeout`` and service managers send) as this
    exception, so it cleans up temporary files and checkpoints resumable work exactly as Ctrl-C
    does. It prints ``pitools: error: interrupted`` (followed by ``hint``: how to resume) and exits
    with the shell's status for the signal, 128 + its number.
    """

    def __init__(self, hint: str = "", signal_number: int = signal.SIGINT):
        super().__init__(hint)
        self.hint = hint
        self.signal_number = signal_number

    @classmethod
    def of(cls, exc: KeyboardInterrupt) -> "Interrupted":
        """A plain KeyboardInterrupt (Ctrl-C) as an Interrupted; an Interrupted as itself."""
        return exc if isinstance(exc, Interrupted) else cls()

    def resumable(self, hint: str) -> "Interrupted":
        """The same interruption, telling the user how to resume."""
        return Interrupted(hint, self.signal_number)
