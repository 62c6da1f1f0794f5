"""`python -m pipeline.train`."""

import sys

from pipeline.train.loop import main

sys.exit(main())
