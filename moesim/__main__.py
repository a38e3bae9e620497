"""``python -m moesim``: the command line, as the ``moesim`` script."""

import sys

from moesim.cli import main

sys.exit(main())
