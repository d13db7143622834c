"""``python -m fastcifar COMMAND ...``: the ``fastcifar`` command (``fastcifar.cli.main``)."""

import sys

from fastcifar.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m fastcifar"))
