import sys

from pd.tools.gpu_check.check import main

sys.exit(main())
