"""``python -m scripts.bench NAME [ARGS]``: the bench commands (``python -m scripts.bench`` lists them)."""

import sys

from scripts.harness.registry import main

if __name__ == "__main__":
    sys.exit(main("bench"))
