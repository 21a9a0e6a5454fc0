"""``python -m scripts.bench.init`` was the init benchmark's entry point: name the new one, exit 2."""

from scripts.harness.registry import moved

if __name__ == "__main__":
    moved("bench", "init")
