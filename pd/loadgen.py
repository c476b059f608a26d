"""Entry point: `python -m pd.loadgen` runs `pd.tools.loadgen`."""
import sys

from pd.tools.loadgen import main

if __name__ == "__main__":
    sys.exit(main())
