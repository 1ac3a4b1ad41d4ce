"""An LLM that misbehaves does not end a run (docs/decisions/0016-llm-faults.md): full OptimizeKernel
runs on the real Temporal dev server, the real `openai` client and the scripted server on 127.0.0.1.

- an unusable reply (prose, truncated, refused: test_llm_workflow, megabytes) fails that candidate, with its reason in
  the round's record, and the round goes on; after 3 in a row the role's offline stand-in takes over;
- an unavailable endpoint (500s, no answer) is retried with backoff until it answers again, or until
  the wall-time budget, which stops the run cleanly with the reason;
- an error no retry can fix (401) stops the run at once with that reason; the baseline is kept;
- a 10-round run whose endpoint flips between healthy, 500, hanging and garbage completes, every
  round accounted for and every call's cost counted once.
"""

from __future__ import annotations

import pytest

import tests.test_llm_workflow as llm_workflow
from agents.llm import MAX_REPLY_CHARS
from tests.conftest import QUICK
from tests.fake_openai import Delay, FakeOpenAI, Reply, Status
from tests.test_llm_workflow import (  # noqa: F401 - settings and llm_env are fixtures
    CALL_COST,
    ROUND1_SOURCE,
    check_common,
    code,
    design,
    diagnosis,
    execute,
    llm_calls,
    llm_env,
    make_request,
    plan,
    role_of,
    round1,
    settings,
    source,
)

PROSE = "Sure! Here is a faster kernel. I unrolled the loop and it should be about twice as fast."


def test_prose_from_the_coder_fails_its_candidate_and_the_offline_coder_takes_over(temporal_server, settings,
                                                                                   llm_env):
    bad_round = [diagnosis(), plan(8, "REPEAT 16 -> 8"), Reply.raw(PROSE), Reply.raw(PROSE)]  # reply + repair turn
    script = [design(), *bad_round * 3, diagnosis(), plan(8, "REPEAT 16 -> 8 once more")]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK, rounds=4))
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed", run.error
    rounds = run.result.rounds
    assert [r.round for r in rounds] == [1, 2, 3, 4]
    for r in rounds[:3]:
        assert not r.compiled and r.failure.startswith("coder: unusable reply: the model's reply was still invalid")
        assert "not valid JSON" in r.failure
    # Round 4: the LLM planner's plan, written by the offline coder (no coder request reached the server).
    assert rounds[3].compiled and rounds[3].correct and rounds[3].tunables == {"REPEAT": 8}
    assert [role_of(r) for r in srv.requests][-2:] == ["analyst", "planner"]
    assert len(srv.requests) == len(script)
    usage = run.result.usage
    assert usage.llm_calls == len(script)  # the failed coder calls counted once each, with their tokens
    assert usage.cost_usd == pytest.approx(len(script) * CALL_COST)
    coder = [c for c in llm_calls(run.view) if c.role == "coder"]
    assert len(coder) == 6
    # Each unusable reply is in history whole, with the prompt that asked for it (found against llama.cpp's
    # server: a retryable error kept only 300 characters of each reply and no prompt; tests/test_local_model.py).
    assert all(c.messages and c.response_text == PROSE for c in coder), [(len(c.messages), c.response_text)
                                                                         for c in coder]  # fmt: skip


def test_a_five_megabyte_reply_fails_its_candidate_without_breaking_history(temporal_server, settings, llm_env):
    huge = Reply.raw("x" * (5 << 20))
    script = [design(), diagnosis(), plan(8, "REPEAT 16 -> 8"), huge, huge, *round1()]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK, rounds=2))
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed", run.error
    first, second = run.result.rounds
    assert not first.compiled and f"longer than {MAX_REPLY_CHARS} characters" in first.failure
    assert second.compiled and second.correct
    coder = [c for c in llm_calls(run.view) if c.role == "coder"]
    assert all(len(c.response_text or "") <= MAX_REPLY_CHARS for c in coder)
    assert len(run.history.to_json()) < 4 << 20  # two 5 MB replies, yet the whole history stays small


def test_an_endpoint_that_comes_back_resumes_the_run_by_itself(temporal_server, settings, llm_env):
    llm_env.setenv("KOPT_OPENAI_TIMEOUT_S", "1")
    outage = [Status(500, message="upstream overloaded"), Delay(3), Status(503), Status(502)]
    script = [design(), diagnosis(), *outage, *round1()[1:]]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK))
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed" and run.result.rounds[0].correct
    plan_call = next(c for c in run.view_calls() if c.activity == "plan")
    assert plan_call.attempts == 5 and plan_call.failure is None  # four failed attempts, waited out
    planners = [c for c in llm_calls(run.view) if c.role == "planner"]
    assert len(planners) == 5 and [c.activity_attempt for c in planners] == [1, 2, 3, 4, 5]
    assert run.result.usage.llm_calls == 4 + len(outage)


def test_an_endpoint_down_for_good_stops_the_run_at_its_wall_time_budget(temporal_server, settings, llm_env):
    script = [design(), diagnosis()]  # then the script is exhausted: every request gets a 500
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK, "--max-wall-time", "20",
                                                              rounds=3))
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed", run.error
    assert run.result.rounds == [] and run.result.baseline.correct  # the baseline's measurement is kept
    reason = run.result.stop_reason
    assert reason.startswith("wall-time budget reached while waiting for the LLM endpoint (planner"), reason
    assert len(srv.requests) >= 2 + 3  # retried with backoff, not given up after a fixed count


def test_a_rejected_key_stops_the_run_with_that_reason(temporal_server, settings, llm_env):
    script = [design(), diagnosis(), Status(401, message="Incorrect API key provided")]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK, rounds=3))
    assert run.error is None and run.result.status == "completed"
    assert run.result.rounds == [] and run.result.baseline.correct
    assert run.result.stop_reason.startswith("planner: HTTP 401 from")
    assert "the API key was rejected" in run.result.stop_reason
    assert len(srv.requests) == 3  # no retry of a 401


@pytest.mark.slow
def test_ten_rounds_through_a_flapping_endpoint(temporal_server, settings, llm_env):
    """Healthy, 500, hanging and garbage in turn: all 10 rounds happen, each call counted once."""
    llm_env.setenv("KOPT_OPENAI_TIMEOUT_S", "1")
    llm_env.setattr(llm_workflow, "RUN_LIMIT_S", 400)
    script = [design()]
    for rnd in range(1, 11):
        fault = [[], [Status(500)], [Delay(3)], [Reply.raw("garbage, not JSON")]][rnd % 4]
        script += [diagnosis(), *fault, plan(8, f"round {rnd}: REPEAT 16 -> 8"), code(source(f"round {rnd}"))]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK, rounds=10))
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed", run.error
    assert [r.round for r in run.result.rounds] == list(range(1, 11))
    assert all(r.compiled and r.correct for r in run.result.rounds)
    assert srv.script == []  # every scripted reply was asked for
    records = llm_calls(run.view)
    usage = run.result.usage
    assert usage.llm_calls == len(records) == len(srv.requests)
    spent = [c for c in records if c.usage.prompt_tokens]
    assert usage.cost_usd == pytest.approx(sum(c.cost_usd for c in spent))


def test_status_shows_the_wait_for_the_endpoint_while_it_is_down(temporal_server, settings, llm_env):
    """`kopt status` names the wait, since when, the role and the last error, while the run waits."""
    import asyncio
    import io
    import uuid

    from frontend import inspect
    from kopt import queues
    from kopt.run_models import OptimizeResult
    from tests.conftest import cpu_cluster

    script = [design(), diagnosis(), *[Status(500, message="upstream overloaded")] * 5, *round1()[1:]]

    async def main(srv) -> tuple[list[str], OptimizeResult]:
        req = make_request(settings, srv, llm_env, *QUICK)
        seen: list[str] = []
        async with cpu_cluster(temporal_server.address, settings) as client:
            handle = await client.start_workflow(queues.WORKFLOW_NAME, req, id=f"llm-wait-{uuid.uuid4()}",
                                                 task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)
            result = asyncio.ensure_future(handle.result())
            while not result.done():
                out = io.StringIO()
                await inspect.status(client, handle.id, out=out)
                seen += [line.strip() for line in out.getvalue().splitlines() if "waiting for the LLM" in line]
                await asyncio.sleep(0.5)
            return seen, await result

    with FakeOpenAI(script) as srv:
        seen, result = asyncio.run(main(srv))
    assert result.status == "completed" and result.rounds[0].correct
    assert seen, "the wait never showed in kopt status"
    assert seen[-1].startswith("waiting for the LLM endpoint since 20") and "(planner, attempt " in seen[-1]
    assert "HTTP 500 from" in seen[-1] and "upstream overloaded" in seen[-1]


def test_the_cli_names_the_cause_of_a_failed_run():
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import ActivityError, ApplicationError, RetryState

    from kopt.errors import failure_chain

    app = ApplicationError("HTTP 500 from http://h/v1 (model 'm', role planner): overloaded", type="LLMServerError")
    act = ActivityError("activity error", scheduled_event_id=5, started_event_id=6, identity="w", activity_type="plan",
                        activity_id="3", retry_state=RetryState.MAXIMUM_ATTEMPTS_REACHED)
    act.__cause__ = app
    line = failure_chain(WorkflowFailureError(cause=act))
    assert line == "activity plan: HTTP 500 from http://h/v1 (model 'm', role planner): overloaded"


def test_resume_continues_from_the_last_finished_round_without_paying_again(temporal_server, settings, llm_env):
    """Round 2's coder gets a 401: the run stops after paying round 2's analyst and planner. `kopt
    resume` continues in a new run from round 2; those two answers come from the reply cache (no
    request reaches the server), the coder is asked again, and round 3 follows."""
    import asyncio

    from frontend.runs import resume_point
    from kopt import queues
    from kopt.run_models import OptimizeResult
    from tests.conftest import cpu_cluster

    round2 = [diagnosis(), plan(4, "REPEAT 8 -> 4")]
    first_script = [design(), *round1(), *round2, Status(401, message="key revoked")]
    second_script = [code(source("round 2 after the resume")), diagnosis(), plan(2, "REPEAT 4 -> 2"),
                     code(source("round 3"))]

    async def resume() -> tuple[str, OptimizeResult]:
        async with cpu_cluster(temporal_server.address, settings) as client:
            req, new_id = await resume_point(client, settings, first.workflow_id)
            assert new_id == f"{first.workflow_id}-resumed-1" and req.state.next_round == 2
            handle = await client.start_workflow(queues.WORKFLOW_NAME, req, id=new_id,
                                                 task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)
            return new_id, await asyncio.wait_for(handle.result(), 120)

    with FakeOpenAI(first_script) as srv:  # one endpoint: the key is fixed between the two runs
        first = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK, rounds=3))
        assert first.result.llm_stopped and first.result.stop_reason.startswith("coder: HTTP 401")
        assert [r.round for r in first.result.rounds] == [1]
        before = len(srv.requests)
        srv.push(*second_script)
        new_id, result = asyncio.run(resume())
        asked = [role_of(r) for r in srv.requests[before:]]
    assert asked == ["coder", "analyst", "planner", "coder"]  # round 2's analyst and planner: from the cache
    assert result.status == "completed" and not result.llm_stopped
    assert [r.round for r in result.rounds] == [1, 2, 3] and all(r.correct for r in result.rounds)
    paid_before = first.result.usage.cost_usd
    assert result.usage.cost_usd == pytest.approx(paid_before + len(second_script) * CALL_COST)
