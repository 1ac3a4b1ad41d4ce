"""Keep an activity's heartbeat going while it awaits something long (a compiler, a child process).

A worker that dies stops heartbeating, so Temporal retries the activity elsewhere after the
heartbeat timeout instead of the whole start-to-close timeout; cancellation also arrives with a
heartbeat response.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from temporalio import activity


@asynccontextmanager
async def heartbeating(detail: str, every_s: float = 2.0):
    async def beat() -> None:
        while True:
            activity.heartbeat(detail)
            await asyncio.sleep(every_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
