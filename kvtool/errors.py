"""The one exception type the CLI turns into a one-line message instead of a traceback."""


class KvtoolError(Exception):
    """A problem with the user's input or environment, stated in one line."""
