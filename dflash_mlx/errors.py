"""The one exception type users see for bad input."""


class DFlashError(Exception):
    """Bad input, a missing file or an incompatible model pair.

    The message is one line naming what is wrong and what to do; the CLI
    prints it as ``error: <message>`` and exits non-zero.
    """
