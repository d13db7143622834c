"""``python -m fastcifar.sweep ...``: ``fastcifar sweep ...``."""

import sys

from fastcifar.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m fastcifar.sweep"))
