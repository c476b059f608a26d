import sys

from pd.tools.loadgen.cli import main

sys.exit(main())
