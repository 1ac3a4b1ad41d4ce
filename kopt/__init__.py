"""kopt core: the contracts every part depends on (models, settings, queue names, activity table, artifact
store, package format); the front end (CLI, workers, server, readers) is kopt.app."""

__version__ = "0.1.0"
