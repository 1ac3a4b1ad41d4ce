"""`python -m kopt ...`: the `kopt` command (kopt/app/cli.py)."""

from kopt.app.cli import entry

entry()
