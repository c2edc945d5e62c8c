"""`python -m parallel_runtime.bench` (what `python -m parallel_runtime bench` runs)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
