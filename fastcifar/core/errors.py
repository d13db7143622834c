"""The errors bad input raises: the commands print each as one line and exit 2."""


class ConfigError(Exception):
    """A setting that cannot work; the CLI prints it as one line and exits 2."""


class DataError(Exception):
    """Input data that cannot be used: missing, of unknown layout, corrupt, or inconsistent."""


def first_line(text: str) -> str:
    """The first line of ``text`` with anything on it, stripped; "" when none has. An error quoted
    in a one-line message: its first line is often empty (a message that starts with a newline)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
