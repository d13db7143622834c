"""The errors bad input raises: the commands print each as one line and exit 2."""


class ConfigError(Exception):
    """A setting that cannot work; the CLI prints it as one line and exits 2."""


class DataError(Exception):
    """Input data that cannot be used: missing, of unknown layout, corrupt, or inconsistent."""
