"""Connecting to Temporal: the configured cluster, or the embedded dev server."""

from __future__ import annotations

import asyncio
import os

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from kopt.settings import Settings


async def connect(address: str, settings: Settings, attempts: int = 50) -> Client:
    """Connect with the pydantic data converter; retry while a just-started server warms up."""
    api_key = os.environ.get(settings.temporal_api_key_env) if settings.temporal_api_key_env else None
    last: Exception | None = None
    for _ in range(attempts):
        try:
            client = await Client.connect(address, namespace=settings.namespace, data_converter=pydantic_data_converter,
                                          tls=settings.temporal_tls or bool(api_key), api_key=api_key)
            await client.workflow_service.get_system_info(_system_info_request())
            return client
        except Exception as exc:  # noqa: BLE001 - server not ready yet; surfaced after the last attempt
            last = exc
            await asyncio.sleep(0.2)
    raise ConnectionError(f"cannot reach Temporal at {address}: {last}")


def _system_info_request():
    from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

    return GetSystemInfoRequest()
