import sys

from pd.tools.load_faults.cli import main

sys.exit(main())
