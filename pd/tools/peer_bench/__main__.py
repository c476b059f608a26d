import sys

from pd.tools.peer_bench.cli import main

sys.exit(main())
