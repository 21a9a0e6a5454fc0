"""``python -m scripts.gpu NAME [ARGS]``: the gpu commands (``python -m scripts.gpu`` lists them)."""

import sys

from scripts.harness.registry import main

if __name__ == "__main__":
    sys.exit(main("gpu"))
