"""Entry point: `python -m pd.launch` runs `pd.deploy.launch`."""
import sys

from pd.deploy.launch import main

if __name__ == "__main__":
    sys.exit(main())
