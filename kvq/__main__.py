"""``python -m kvq``: the ``kvq`` command line."""

import sys

from kvq.cli import main

sys.exit(main())
