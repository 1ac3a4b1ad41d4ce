"""--approve: a new best waits for an Approval update; the validator rejects unknown candidate ids."""

from __future__ import annotations

import asyncio
import io
import uuid

import pytest

from frontend.inspect import approve, status
from temporalio.api.sdk.v1 import WorkflowMetadata

from frontend.runs import prepare_request, start_run
from kopt.errors import UsageError
from kopt.settings import Settings
from tests.conftest import REPO, cpu_cluster
from workflows.optimize import OptimizeKernel


async def _run(server, home):
    settings = Settings(home=home)
    req = prepare_request(REPO / "tests" / "fixtures" / "repeat", "cpu", None, 1, "offline", 0, settings)
    req = req.model_copy(update={"approve": True})
    async with cpu_cluster(server.address, settings) as client:
        wf_id = f"approve-{uuid.uuid4()}"
        handle = await start_run(client, req, wf_id)
        with pytest.raises(UsageError, match="no candidate is waiting"):
            await approve(client, wf_id, "nope", True, out=io.StringIO())
        for _ in range(600):
            progress = await handle.query(OptimizeKernel.progress)
            if progress.pending_approval:
                break
            await asyncio.sleep(0.2)
        pending = progress.pending_approval
        assert pending and progress.phase == "awaiting approval"
        # What the Web UI shows of a live run: its one-line summary, and current details that follow it
        # (its result panel stays empty until the run closes; issue #29 item 11).
        assert await (await handle.describe()).static_summary() == "kopt: repeat on cpu, 1 rounds, provider offline"
        details = (await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)).current_details
        assert details.startswith("**round 1 of 1**: awaiting approval, best 1.000x"), details
        assert f"- candidate {pending} (" in details and f"kopt approve RUN {pending}" in details, details
        shown = io.StringIO()
        await status(client, wf_id, out=shown)
        assert f"waiting for approval of {pending}" in shown.getvalue()
        with pytest.raises(UsageError, match="unknown candidate id"):
            await approve(client, wf_id, "0000000000000000", True, out=io.StringIO())
        await approve(client, wf_id, pending, True, out=io.StringIO())
        return pending, await handle.result()


@pytest.mark.slow
def test_new_best_waits_for_approval(temporal_server, tmp_path):
    pending, result = asyncio.run(_run(temporal_server, tmp_path / "home"))
    assert result.best.candidate_id == pending and result.rounds[0].accepted
