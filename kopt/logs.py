"""structlog set-up, called once from the CLI's main(); never at import time."""

from __future__ import annotations

import logging
import sys

import structlog

from kopt.redact import redact

SECRET_KEYS = ("api_key", "authorization", "token", "password", "secret")


def _redact(_logger, _name, event: dict) -> dict:
    for key in list(event):
        if any(s in key.lower() for s in SECRET_KEYS):
            event[key] = "***"
        elif isinstance(event[key], str):
            event[key] = redact(event[key])  # a candidate's failure text, say
    return event


def configure(fmt: str = "auto", level: str = "info") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(message)s")
    logging.getLogger("temporalio").setLevel(max(lvl, logging.WARNING))
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            _redact,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
