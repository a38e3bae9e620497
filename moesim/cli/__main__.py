"""``python -m moesim.cli``."""

import sys

from moesim.cli import main

sys.exit(main())
