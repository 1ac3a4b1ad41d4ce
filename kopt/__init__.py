"""kopt core: CLI, settings, shared contracts, queue names, artifact store, embedded server."""

__version__ = "0.1.0"
