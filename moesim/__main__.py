"""``python -m moesim``: the command line, as the ``moesim`` script (same exit status)."""

import sys

from moesim.cli import main

sys.exit(main())
