"""Committed golden histories must replay against the current workflow code.

A workflow change that would break running workflows (non-determinism) fails here; guard such a
change with workflow.patched() and re-record with tests/golden/record.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.optimize import OptimizeKernel

GOLDEN = sorted((Path(__file__).parent / "golden").glob("history-*.json"))


@pytest.mark.parametrize("path", GOLDEN, ids=[p.name for p in GOLDEN])
def test_golden_history_replays(path):
    history = WorkflowHistory.from_json("golden-repeat", path.read_text())
    replayer = Replayer(workflows=[OptimizeKernel], data_converter=pydantic_data_converter)
    result = asyncio.run(replayer.replay_workflow(history, raise_on_replay_failure=False))
    assert result.replay_failure is None, result.replay_failure


def test_golden_histories_exist_and_span_continue_as_new():
    assert len(GOLDEN) >= 2, "record them with python tests/golden/record.py"
    first = json.loads(GOLDEN[0].read_text())
    assert first["events"][0]["eventType"] in ("EVENT_TYPE_WORKFLOW_EXECUTION_STARTED", "WorkflowExecutionStarted")


def _patch_ids(path: Path) -> set[str]:
    import base64

    ids = set()
    for event in json.loads(path.read_text())["events"]:
        marker = event.get("markerRecordedEventAttributes")
        if marker and marker.get("markerName") == "core_patch":
            for payload in marker["details"]["patch-data"]["payloads"]:
                ids.add(json.loads(base64.b64decode(payload["data"]))["id"])
    return ids


def test_a_golden_history_took_each_path_of_the_search():
    """history-*: rounds in step (recorded before asynchronous slots); history-slots2-*: two slots."""
    from workflows.patches import ASYNC_SLOTS_PATCH

    by_name = {p.name: _patch_ids(p) for p in GOLDEN}
    assert ASYNC_SLOTS_PATCH not in by_name["history-1.json"]
    assert all(ASYNC_SLOTS_PATCH in by_name[f"history-slots2-{i}.json"] for i in (1, 2))
