"""``python -m scripts.matrix NAME [ARGS]``: the matrix commands (``python -m scripts.matrix`` lists them)."""

import sys

from scripts.harness.registry import main

if __name__ == "__main__":
    sys.exit(main("matrix"))
