"""``python -m pallas_kernels.tune``: :func:`pallas_kernels.tune.main`."""

import sys

from pallas_kernels.tune import main

sys.exit(main())
