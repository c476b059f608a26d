import sys

from pd.tools.dashboard_render.cli import main

sys.exit(main())
