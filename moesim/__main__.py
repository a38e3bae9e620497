"""``python -m moesim``: the command line, as the ``moesim`` script (with its exit status)."""

from moesim.cli import main

raise SystemExit(main())
