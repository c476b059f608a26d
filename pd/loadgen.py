"""Entry point: `python -m pd.loadgen` runs `pd.tools.loadgen` (pd/tools/loadgen/cli.py)."""
import sys

from pd.tools.loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
