"""Connecting to Temporal: the configured cluster, or the embedded dev server."""

from __future__ import annotations

import asyncio
import os

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode

from kopt.settings import Settings


async def connect(address: str, settings: Settings, attempts: int = 50) -> Client:
    """Connect with the pydantic data converter; retry while a just-started server warms up (nothing
    listens yet, or it answers UNAVAILABLE). Any other error (a malformed address, TLS, a rejected
    key) is raised at once: waiting does not fix it."""
    api_key = os.environ.get(settings.temporal_api_key_env) if settings.temporal_api_key_env else None
    last: Exception | None = None
    for _ in range(attempts):
        try:
            client = await Client.connect(address, namespace=settings.namespace, data_converter=pydantic_data_converter,
                                          tls=settings.temporal_tls or bool(api_key), api_key=api_key)
            await client.workflow_service.get_system_info(_system_info_request())
            return client
        except (RuntimeError, RPCError) as exc:
            if not warming_up(exc):
                raise ConnectionError(f"cannot connect to Temporal at {address}: {exc}") from None
            last = exc
            await asyncio.sleep(0.2)
        except ValueError as exc:  # the SDK's word for an address it cannot parse
            raise ConnectionError(f"cannot connect to Temporal at {address}: {exc}") from None
    raise ConnectionError(f"cannot reach Temporal at {address}: {last}")


def warming_up(exc: BaseException) -> bool:
    """An error a server that is still starting gives: no listener yet, or UNAVAILABLE ("Frontend is not
    healthy yet"). The SDK raises a RuntimeError "Failed client connect: ..." for both; an address it
    cannot parse is a ValueError instead."""
    if isinstance(exc, RPCError):
        return exc.status in (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED)
    return isinstance(exc, RuntimeError) and str(exc).startswith("Failed client connect")


def _system_info_request():
    from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

    return GetSystemInfoRequest()
