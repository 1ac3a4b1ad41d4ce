"""Error helpers: invalid requests are non-retryable, everything else is Temporal's to retry."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

INVALID_REQUEST = "InvalidRequest"


def invalid_request(message: str) -> ApplicationError:
    return ApplicationError(message, type=INVALID_REQUEST, non_retryable=True)
