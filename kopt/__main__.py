"""`python -m kopt ...`: the `kopt` command (frontend/cli.py). The one module of kopt/ that imports
from above: an entry point, not a contract (tests/test_layers.py names it)."""

from frontend.cli import entry

entry()
