"""The front end of kopt: the CLI, the composition root (workers, embedded server, client) and the readers
of runs (history, inspect, report, evaluate). It sits above every layer it uses; nothing below imports
it (tests/test_layers.py)."""
