"""kopt core: the contracts every part depends on (models, settings, queue names, activity table, artifact
store, package format). Containment of untrusted code is containment/; the front end is frontend/."""

__version__ = "0.1.0"
