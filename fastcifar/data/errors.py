"""The one exception the data layer raises for bad input; the CLI prints it as one line, exit 2."""


class DataError(Exception):
    """Input data that cannot be used: missing, of unknown layout, corrupt, or inconsistent."""
