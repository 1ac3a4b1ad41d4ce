"""Grouping a run's activity calls into round views (frontend/history.py) without a server."""

from __future__ import annotations

from frontend.history import ActivityCall, rounds_by_id
from kopt.activity_table import ANALYZE, PLAN
from kopt.agent_models import LLMCall, LLMMessage


def _analyst_call(rnd: int, error: str) -> ActivityCall:
    call = LLMCall(role="analyst", model="m", temperature=None, base_url_host="127.0.0.1:8000",
                   messages=[LLMMessage(role="user", content="the prompt")], error=error)  # fmt: skip
    return ActivityCall(activity=ANALYZE.name, task_queue="kopt-agents", at=(rnd, 0), failure=error,
                        failed_llm_calls=[call])  # fmt: skip


def test_a_round_that_ended_at_its_analysts_call_keeps_that_call():
    """A run stopped by its analyst's refused request (HTTP 400 for a prompt over the context window, found
    against llama.cpp's server) had no view for that round: the call and its error were not in `kopt
    history`, though the run's usage counted it."""
    refused = _analyst_call(2, "HTTP 400: the request exceeds the context window")
    planned = ActivityCall(activity=PLAN.name, task_queue="kopt-agents", at=(1, 0))
    views = rounds_by_id([planned, refused], segment=1)
    assert [v.round for v in views] == [1, 2]
    (call,) = views[1].llm_calls
    assert call.role == "analyst" and call.error.startswith("HTTP 400") and call.messages
