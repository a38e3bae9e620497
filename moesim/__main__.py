"""``python -m moesim``: the command line, as the ``moesim`` script."""

from moesim.cli import main

main()
