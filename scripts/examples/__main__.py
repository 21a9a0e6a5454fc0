"""``python -m scripts.examples NAME [ARGS]``: the examples commands (``python -m scripts.examples`` lists them)."""

import sys

from scripts.harness.registry import main

if __name__ == "__main__":
    sys.exit(main("examples"))
