"""The LLM agent team inside full OptimizeKernel runs: a real Temporal dev server, in-process workers
for every role, the real `openai` client talking to a scripted server on 127.0.0.1
(tests/fake_openai.py), and the CPU fixture package tests/fixtures/repeat.

Every run is checked from workflow history (frontend.history.load_run: activities, task queues, each
round's LLM calls with their prompts and responses, attempts) and from the report. The module
shares one KOPT_HOME, so the content-addressed compile and evaluation caches make repeated
candidates cheap; the scripted coder writes the same sources in different tests on purpose.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHistory

from frontend.cli import _parser
from frontend.history import ActivityCall, RunView, activity_calls, load_run
from frontend.report import build_report, render_markdown
from frontend.runs import apply_run_options, prepare_request
from kopt import queues
from kopt.agent_models import LLMCall
from kopt.report_models import RunReport
from kopt.run_models import OptimizeRequest, OptimizeResult
from kopt.settings import Settings
from tests.conftest import QUICK, REPO, cpu_cluster, kopt_env
from tests.fake_openai import Delay, FakeOpenAI, Received, Reply, Status

FIXTURE = REPO / "tests" / "fixtures" / "repeat"
KEY_ENV = "KOPT_TEST_WORKFLOW_LLM_KEY"
KEY = "sk-test-workflow-NEVER-IN-HISTORY-9a8b7c"
MODEL = "test-model"
PRICE_IN, PRICE_OUT = 2.0, 8.0  # USD per 1M tokens
PRICES = {MODEL: (PRICE_IN, PRICE_OUT)}
CALL_COST = (100 * PRICE_IN + 50 * PRICE_OUT) / 1e6  # the fake server's default usage: 100 in, 50 out
SEED = 5
MIN_SPEEDUP = 1.2  # half the passes (REPEAT 16 -> 8) measures ~1.9x on an idle CPU; margin for a busy one
RUN_LIMIT_S = 90
AGENTS, BUILD, EXEC = queues.AGENTS_QUEUE, queues.build_queue("cpu"), queues.EXEC_CPU_QUEUE
QUEUE_OF = {"design_tests": AGENTS, "analyze": AGENTS, "plan": AGENTS, "code": AGENTS, "repair": AGENTS,
            "single_agent": AGENTS, "compile": BUILD, "test": EXEC, "profile": EXEC}

BASE_SOURCE = (FIXTURE / "kernel.cpp").read_text()
OLD_LINE = "out[i] = 2.0f * x[i] + zero * acc;"
assert OLD_LINE in BASE_SOURCE


def source(marker: str, body: str = "out[i] = x[i] + x[i] + zero * acc;") -> str:
    """A coder's complete source: the baseline with its loop body rewritten (a real change)."""
    return BASE_SOURCE.replace(OLD_LINE, f"{body}  // {marker}")


ROUND1_SOURCE = source("round 1: add instead of multiply")
ROUND2_SOURCE = source("round 2: add, fewer passes")
BROKEN_SOURCE = source("does not compile", "out[i] = undeclared_helper(x[i]);")

# ------------------------------------------------------------------------- scripted replies

DESIGN = {"shapes": [{"dims": {"N": 7}, "reason": "odd size, a remainder against any vector width"},
                     {"dims": {"N": 0}, "reason": "empty input"}],
          "notes": "small odd sizes"}
DIAGNOSIS = {"bottleneck": "REPEAT passes over the same data dominate", "evidence": ["REPEAT * 32 multiply-adds per element"],
             "suggestions": ["lower REPEAT", "add instead of multiply"]}


def design(**kw) -> Reply:
    return Reply.json(DESIGN, **kw)


def diagnosis(**kw) -> Reply:
    return Reply.json(DIAGNOSIS, **kw)


def plan(repeat: int | None, description: str, flags: list[str] | None = None, **kw) -> Reply:
    tunables = {} if repeat is None else {"REPEAT": repeat}
    return Reply.json({"description": description, "rationale": "fewer passes over memory", "tunables": tunables,
                       "flags": flags}, **kw)


def code(src: str, **kw) -> Reply:
    return Reply.json({"source": src, "summary": "rewrote the loop body"}, **kw)


def round1() -> list[Reply]:
    return [diagnosis(), plan(8, "REPEAT 16 -> 8, add instead of multiply"), code(ROUND1_SOURCE)]


def round2() -> list[Reply]:
    return [diagnosis(), plan(4, "REPEAT 8 -> 4"), code(ROUND2_SOURCE)]


def role_of(received: Received) -> str:
    """Which agent a request came from, by its system prompt."""
    system = received.messages[0]["content"]
    for marker, role in (("Role: test designer", "test_designer"), ("Role: profile analyst", "analyst"),
                         ("Role: planner", "planner"), ("Role: coder, repair turn", "repair"),
                         ("Role: coder.", "coder"), ("Role: kernel engineer", "single_agent")):
        if marker in system:
            return role
    raise AssertionError(f"unknown role: {system[:200]}")


# ------------------------------------------------------------------------- running a workflow


@dataclass
class Run:
    req: OptimizeRequest
    workflow_id: str
    run_id: str
    result: OptimizeResult | None
    error: WorkflowFailureError | None
    view: RunView
    history: WorkflowHistory
    seconds: float

    def view_calls(self) -> list[ActivityCall]:
        """Every activity of the (single-segment) run, in scheduling order."""
        return activity_calls(self.history)

    def report(self) -> RunReport:
        assert self.result is not None
        return build_report(self.workflow_id, self.run_id, self.req, self.result, None)


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    return Settings(home=tmp_path_factory.mktemp("kopt-llm-workflow"))


@pytest.fixture(autouse=True)
def llm_env(monkeypatch, settings):
    """The agent worker's key variable; KOPT_OPENAI_* as a user would set them (base URL per test);
    KOPT_HOME (the reply cache) in the module's home."""
    monkeypatch.setenv("KOPT_HOME", str(settings.home))
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv("KOPT_OPENAI_API_KEY_ENV", KEY_ENV)
    monkeypatch.setenv("KOPT_OPENAI_MODEL", MODEL)
    monkeypatch.setenv("KOPT_OPENAI_TIMEOUT_S", "5")
    monkeypatch.setenv("KOPT_OPENAI_PRICES", json.dumps(PRICES))
    for var in ("KOPT_OPENAI_ROLES", "KOPT_OPENAI_TEMPERATURE", "KOPT_TEMPORAL_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def make_request(settings: Settings, srv: FakeOpenAI | None, monkeypatch, *options: str, rounds: int = 1,
                 provider: str = "openai") -> OptimizeRequest:
    """The request `kopt optimize tests/fixtures/repeat --provider ... <options>` would start."""
    if srv is not None:
        monkeypatch.setenv("KOPT_OPENAI_BASE_URL", srv.base_url)
    args = _parser().parse_args(["optimize", str(FIXTURE), "--rounds", str(rounds), "--provider", provider,
                                 "--seed", str(SEED), *options])
    req = prepare_request(args.kernel_dir, args.target, args.gpu_class, args.rounds, args.provider, args.seed,
                          settings)
    return apply_run_options(req, args, settings)


async def _execute(server, settings: Settings, req: OptimizeRequest) -> Run:
    result = error = None
    async with cpu_cluster(server.address, settings) as client:
        start = time.monotonic()
        handle = await client.start_workflow(queues.WORKFLOW_NAME, req, id=f"llm-wf-{uuid.uuid4()}",
                                             task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)
        try:
            result = await asyncio.wait_for(handle.result(), RUN_LIMIT_S)
        except WorkflowFailureError as exc:
            error = exc
        except asyncio.TimeoutError:
            await handle.terminate("test: the run did not finish in time")
            history = await handle.fetch_history()
            task_failures = [e.workflow_task_failed_event_attributes.failure.message for e in history.events
                             if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
            pytest.fail(f"run did not finish in {RUN_LIMIT_S}s; workflow task failures: {task_failures[:3]}")
        seconds = time.monotonic() - start
        view = await load_run(client, handle.id)
        history = await handle.fetch_history()
    return Run(req, handle.id, handle.result_run_id or "", result, error, view, history, seconds)


def execute(server, settings: Settings, req: OptimizeRequest) -> Run:
    return asyncio.run(_execute(server, settings, req))


def check_common(run: Run, srv: FakeOpenAI | None) -> None:
    """What holds for every run: queues, audit records that match the wire, no key in history."""
    calls = run.view_calls()
    for call in calls:
        assert call.task_queue == QUEUE_OF[call.activity], (call.activity, call.task_queue)
    assert KEY not in run.history.to_json()
    if srv is None:
        return
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in srv.requests)
    assert all(r.body["model"] == MODEL for r in srv.requests)


def llm_calls(view: RunView) -> list[LLMCall]:
    return [c for r in view.rounds for c in r.llm_calls]


def matches_wire(call: LLMCall, received: Received) -> bool:
    return [m.model_dump() for m in call.messages] == received.messages


# ------------------------------------------------------------------------- (1) a good run


@pytest.mark.slow
def test_good_two_round_run(temporal_server, settings, llm_env):
    script = [design(), *round1(), *round2()]
    with FakeOpenAI(script) as srv:
        req = make_request(settings, srv, llm_env, rounds=2)
        run = execute(temporal_server, settings, req)
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed" and run.result.stop_reason is None
    assert [role_of(r) for r in srv.requests] == ["test_designer", *["analyst", "planner", "coder"] * 2]
    # The facts of the machine that timed the baseline, from its worker, in every analyst, planner and
    # coder prompt (issue #27): the instruction sets, the cores, and how timing runs.
    for r in srv.requests[1:]:
        assert "instruction sets: " in r.text and "cores available" in r.text and "timing: each bench shape" in r.text
        # The toolchain that builds the candidates, from the build worker: compiler and version, the allowed
        # headers and options, the toolkit's declarations (#27 item 1).
        assert "- compiler: g++ " in r.text and "every build: g++ -std=c++17 -shared" in r.text, r.text[-3000:]
        assert "<immintrin.h>" in r.text and "allowed compiler options: " in r.text and "-march=<cpu>" in r.text
        assert "kopt_cpu_half.h declares: " in r.text and "static inline float f16_to_f32(uint16_t h)" in r.text
    for r in srv.requests:  # the reference's semantics and the tolerances: what the outputs must match
        if role_of(r) in ("planner", "coder"):
            assert "def reference(inputs)" in r.text and "float32: atol 1e-05, rtol 1.3e-06" in r.text, r.text[-800:]

    # Activities in order, each on its queue.
    names = [c.activity for c in run.view_calls()]
    assert names == ["design_tests", "compile", "test", "profile",
                     *["analyze", "plan", "code", "compile", "test", "profile"] * 2,
                     "profile",  # round 2 against round 1's best, head to head (docs/decisions/0037)
                     "test", "profile"]  # the best on the held-out shapes, after the last round

    # Round 0: the test designer's valid shape is added to every test, the invalid one is rejected.
    zero = run.view.rounds[0]
    design_out = zero.calls[0].result
    assert [s.dims for s in design_out.review.accepted] == [{"N": 7}]
    assert len(design_out.review.rejected) == 1 and "N=0 is outside [1, 100]" in design_out.review.rejected[0]
    *tests, held_out = [c for c in run.view_calls() if c.activity == "test"]
    for t in tests:
        labels = [s.dims for s in t.input.shapes]
        assert labels == [{"N": 1}, {"N": 100}, {"N": 7}], labels
    assert held_out.input.shapes == run.req.holdout_shapes and len(run.req.holdout_shapes) == 2
    (designer,) = zero.llm_calls
    assert designer.role == "test_designer" and matches_wire(designer, srv.requests[0])
    assert designer.response_text == json.dumps(DESIGN)
    assert '{"N": 100}' in designer.messages[1].content and "#define REPEAT 16" in designer.messages[1].content

    # Rounds 1 and 2: analyst, planner, coder; prompts as sent, responses as received.
    assert [r.round for r in run.view.rounds] == [0, 1, 2]
    wire = iter(srv.requests[1:])
    for view in run.view.rounds[1:]:
        assert [c.role for c in view.llm_calls] == ["analyst", "planner", "coder"]
        for call in view.llm_calls:
            assert matches_wire(call, next(wire))
            assert call.error is None and call.output and call.attempt == 1 and not call.repair
            assert call.usage.prompt_tokens == 100 and call.cost_usd == pytest.approx(CALL_COST)
        assert view.diagnosis.bottleneck == DIAGNOSIS["bottleneck"]
        assert view.compile.ok and view.test.correct and view.profile.ok
        assert view.code.candidate.id == view.candidate_id
    r1, r2 = run.view.rounds[1:]
    analyst1, planner1, coder1 = r1.llm_calls
    # The analyst sees the baseline's real timings; the coder the plan and the base source.
    assert "N=4096 float32: median" in analyst1.messages[1].content
    assert "REPEAT 16 -> 8, add instead of multiply" in coder1.messages[1].content
    assert BASE_SOURCE.strip() in coder1.messages[1].content
    assert r1.code.candidate.source == ROUND1_SOURCE.replace("#define REPEAT 16", "#define REPEAT 8")
    assert "+    out[i] = x[i] + x[i] + zero * acc;  // round 1: add instead of multiply" in r1.code.diff
    # Round 2's planner sees round 1 in its history and plans from round 1's candidate.
    planner2 = r2.llm_calls[1]
    assert "round 1: REPEAT 16 -> 8, add instead of multiply" in planner2.messages[1].content
    assert r1.candidate_id in planner2.messages[1].content
    assert r2.code.candidate.parent_id == r1.candidate_id and "#define REPEAT 4" in r2.code.candidate.source

    res = run.result
    assert [r.candidate_id for r in res.rounds] == [r1.candidate_id, r2.candidate_id]
    assert res.rounds[0].accepted and res.rounds[0].speedup_geomean > MIN_SPEEDUP  # half the passes
    assert res.best.candidate_id in {r1.candidate_id, r2.candidate_id} and res.best.speedup_geomean > MIN_SPEEDUP
    assert res.usage.llm_calls == 7 and res.usage.unpriced_calls == 0
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (700, 350)
    assert res.usage.cost_usd == pytest.approx(7 * CALL_COST)
    assert res.usage.device_seconds > 0

    report = run.report()
    assert report.provider == "openai" and report.model == MODEL and report.status == "completed"
    assert report.usage.llm_calls == 7 and report.usage.cost_usd == pytest.approx(7 * CALL_COST)
    assert len(report.rounds) == 2 and report.best.candidate_id == res.best.candidate_id
    md = render_markdown(report, "kernel.cpp")
    assert f"model {MODEL}" in md and "7 LLM calls, 700 + 350 tokens" in md


# ------------------------------------------------------------------------- (2) malformed JSON


def test_malformed_planner_json_is_repaired_on_the_second_reply(temporal_server, settings, llm_env):
    broken = '{"description": "REPEAT 16 -> 8", "rationale": '  # cut off
    script = [design(), diagnosis(), Reply.raw(broken), plan(8, "REPEAT 16 -> 8, add instead of multiply"),
              code(ROUND1_SOURCE)]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK))
    check_common(run, srv)
    assert run.result.status == "completed" and len(run.result.rounds) == 1
    first, second = [c for c in run.view.rounds[1].llm_calls if c.role == "planner"]
    assert first.attempt == 1 and first.response_text == broken and first.error.startswith("not valid JSON")
    assert first.output is None
    assert second.attempt == 2 and second.repair and second.error is None
    assert second.output["tunables"] == {"REPEAT": 8}
    # The repair turn: the same conversation, the bad reply, and what was wrong with it.
    assert matches_wire(second, srv.requests[3])
    assert [m.role for m in second.messages] == ["system", "user", "assistant", "user"]
    assert second.messages[2].content == broken and "not valid JSON" in second.messages[3].content
    plan_call = next(c for c in run.view_calls() if c.activity == "plan")
    assert plan_call.attempts == 1  # repaired inside one activity attempt, not by a retry
    assert run.result.rounds[0].compiled and run.result.rounds[0].correct
    assert run.result.usage.llm_calls == 5


# ------------------------------------------------------------------------- (3) refusal


@pytest.mark.parametrize("before", [[], [Status(429, {"Retry-After": "1"})]], ids=["first-attempt", "after-a-429"])
def test_refusal_fails_its_candidate_without_a_retry(temporal_server, settings, llm_env, before):
    """A refusal is an unusable reply: that candidate fails with the reason, the run goes on (here it
    ends after its one round); the refused call is in history in full."""
    script = [design(), diagnosis(), *before, Reply.refused("I can't help with optimizing this."), *round1()]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK))
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed"
    (record,) = run.result.rounds
    assert record.failure.startswith("planner: unusable reply: the model refused (role planner")
    assert "I can't help with optimizing this." in record.failure and not record.compiled
    assert len(srv.requests) == 3 + len(before)  # no repair turn, no retry after the refusal
    assert run.view.status == "completed"
    plan_call = next(c for c in run.view_calls() if c.activity == "plan")
    assert plan_call.attempts == 1 + len(before) and plan_call.result is None
    assert plan_call.failure.startswith("the model refused (role planner")
    # Every planner call is in history with the failure; the refused one in full, prompt included.
    planners = [c for c in llm_calls(run.view) if c.role == "planner"]
    assert [c.activity_attempt for c in planners] == list(range(1, len(before) + 2))
    assert planners[-1].error.startswith("refused") and matches_wire(planners[-1], srv.requests[-1])
    if before:
        assert planners[0].error.startswith("LLMRateLimited") and plan_call.last_failure.startswith("HTTP 429")
    assert not [c for c in run.view_calls() if c.activity == "code"]


# ------------------------------------------------------------------------- (4-6) retried by Temporal


@pytest.mark.parametrize(("failures", "message", "record_error", "min_s"), [
    ([Status(429, {"Retry-After": "1"}, "Rate limit reached for test-model")], "HTTP 429 from", "LLMRateLimited: ",
     1.0),
    ([Status(500, message="upstream overloaded")], "HTTP 500 from", "LLMServerError: ", 1.0),
    ([Delay(6)], "no reply from", "LLMTimeout: ", 2.0),  # the 1 s client timeout, then the 1 s retry interval
], ids=["429-retry-after", "500", "timeout"])
def test_transient_failure_is_retried_by_temporal(temporal_server, settings, llm_env, failures, message,
                                                  record_error, min_s):
    """The planner's first activity attempt fails retryably; Temporal's second attempt succeeds."""
    if isinstance(failures[0], Delay):
        llm_env.setenv("KOPT_OPENAI_TIMEOUT_S", "1")
    script = [design(), diagnosis(), *failures, *round1()[1:]]
    with FakeOpenAI(script) as srv:
        req = make_request(settings, srv, llm_env, *QUICK)
        start = time.monotonic()
        run = execute(temporal_server, settings, req)
        elapsed = time.monotonic() - start
    check_common(run, srv)
    assert run.error is None and run.result.status == "completed" and len(run.result.rounds) == 1
    assert [role_of(r) for r in srv.requests] == ["test_designer", "analyst", *["planner"] * (len(failures) + 1),
                                                  "coder"]
    plan_call = next(c for c in run.view_calls() if c.activity == "plan")
    assert plan_call.attempts == 2 and plan_call.failure is None  # the second activity attempt succeeded
    assert plan_call.last_failure.startswith(message), plan_call.last_failure
    # The failed attempt's audit records (compact: no prompt, the retry sends the same one) come back
    # with the successful attempt's result, so the round shows them and the run's usage counts them.
    planners = [c for c in run.view.rounds[1].llm_calls if c.role == "planner"]
    assert planners == plan_call.result.calls
    *failed, good = planners
    assert len(failed) == len(failures) and [c.activity_attempt for c in planners] == [1] * len(failures) + [2]
    assert all(c.error and c.output is None and not c.messages for c in failed)
    assert failed[0].error.startswith(record_error), failed[0].error
    assert good.error is None and good.output["tunables"] == {"REPEAT": 8} and good.messages
    assert matches_wire(good, srv.requests[-2])
    assert elapsed >= min_s
    replies = [f for f in failures if isinstance(f, Reply)]  # tokens spent by the failed attempt
    usage = run.result.usage
    assert usage.llm_calls == 4 + len(failures) and usage.prompt_tokens == 100 * (4 + len(replies))
    assert usage.cost_usd == pytest.approx((4 + len(replies)) * CALL_COST)


# ------------------------------------------------------------------------- (7) compile repair


def test_compile_error_gets_one_repair_turn(temporal_server, settings, llm_env):
    script = [design(), diagnosis(), plan(8, "REPEAT 16 -> 8 with a helper"), code(BROKEN_SOURCE),
              code(ROUND1_SOURCE, prompt_tokens=300)]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env))
    check_common(run, srv)
    assert [role_of(r) for r in srv.requests] == ["test_designer", "analyst", "planner", "coder", "repair"]
    names = [c.activity for c in run.view_calls()]
    assert names[4:] == ["analyze", "plan", "code", "compile", "repair", "compile", "test", "profile",
                         "test", "profile"]  # the last two: the best on the held-out shapes
    compiles = [c for c in run.view_calls() if c.activity == "compile"]
    failed, fixed = compiles[1].result, compiles[2].result
    assert not failed.ok and "undeclared_helper" in failed.log_tail and fixed.ok

    # The repair prompt carries the compiler's error and the failed source.
    repair_prompt = srv.requests[4].messages[1]["content"]
    error_line = next(line for line in failed.log_tail.splitlines() if "error" in line)
    assert error_line.strip() in repair_prompt and "undeclared_helper(x[i])" in repair_prompt
    view = run.view.rounds[1]
    assert [c.role for c in view.llm_calls] == ["analyst", "planner", "coder", "repair"]
    assert matches_wire(view.llm_calls[3], srv.requests[4])
    repair_call = next(c for c in run.view_calls() if c.activity == "repair")
    assert repair_call.input.failed.source == BROKEN_SOURCE.replace("#define REPEAT 16", "#define REPEAT 8")
    assert repair_call.input.compile_error in repair_prompt

    # The round records the repaired candidate, evaluated.
    (record,) = run.result.rounds
    assert record.candidate_id == repair_call.result.result.candidate.id == view.candidate_id
    assert record.description.endswith("(repaired)") and record.compiled and record.correct
    assert record.speedup_geomean > MIN_SPEEDUP and record.accepted
    assert view.compile.ok and view.test.correct and view.profile.ok
    assert run.result.usage.llm_calls == 5 and run.result.usage.prompt_tokens == 4 * 100 + 300


# ------------------------------------------------------------------------- (8) budgets


@pytest.mark.parametrize(("option", "reason"), [
    (["--max-tokens", "500"], "token budget reached (600 >= 500)"),
    (["--max-cost", "0.002"], "cost budget reached ($0.0024 >= $0.002)"),
], ids=["tokens", "cost"])
def test_budget_stops_the_run_cleanly_after_round_one(temporal_server, settings, llm_env, option, reason):
    with FakeOpenAI([design(), *round1(), *round2()]) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *option, rounds=3))
    check_common(run, srv)
    res = run.result
    assert res.status == "completed" and res.stop_reason == reason
    assert len(res.rounds) == 1 and len(srv.requests) == 4  # round 0 and round 1 only
    assert res.best.candidate_id == res.rounds[0].candidate_id and res.best.round == 1
    assert res.usage.llm_calls == 4 and res.usage.cost_usd == pytest.approx(4 * CALL_COST)
    report = run.report()
    assert report.stop_reason == reason and report.rounds_requested == 3
    assert f"stopped early: {reason}" in render_markdown(report, "kernel.cpp")


# ------------------------------------------------------------------------- (9) candidates per round


@pytest.mark.slow
def test_two_candidates_per_round_offline(temporal_server, settings, llm_env):
    run = execute(temporal_server, settings, make_request(settings, None, llm_env, "--candidates", "2", *QUICK,
                                                          rounds=2, provider="offline"))
    check_common(run, None)
    res = run.result
    assert res.status == "completed" and run.req.llm is None
    assert [(r.round, r.slot) for r in res.rounds] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    ids = [r.candidate_id for r in res.rounds]
    assert len(set(ids)) == 4 and run.req.baseline.id not in ids
    assert len({(json.dumps(r.tunables, sort_keys=True), tuple(r.flags)) for r in res.rounds}) == 4
    # Asynchronous slots (decision 0041): each candidate is compared with the best as it finishes, so every
    # correct one without a regression is either the new best or refused with its reason.
    assert all(r.accepted or r.refusal or not r.correct or r.regressions for r in res.rounds), res.rounds
    names = [c.activity for c in run.view_calls()]
    assert names.count("plan") == names.count("code") == 4 and names.count("compile") == 5
    assert names.count("test") == 5 + 1 and "analyze" not in names and "design_tests" not in names  # + held-out
    # One history view per candidate, each with its own compile, test and profile.
    assert [(v.round, v.candidate_id) for v in run.view.rounds[1:]] == [(r.round, r.candidate_id) for r in res.rounds]
    for view in run.view.rounds[1:]:
        assert view.compile.candidate_id == view.candidate_id and view.test.candidate_id == view.candidate_id
        assert not view.llm_calls
    assert res.usage.llm_calls == 0 and run.report().candidates_per_round == 2
    # Every activity id names its round and slot (kopt/activity_table.py); history groups by them.
    assert all(c.at is not None and c.activity_id.startswith(f"r{c.at[0]}.s{c.at[1]}.{c.activity}.")
               for c in run.view_calls())  # fmt: skip
    views = [{c.at for c in v.calls} for v in run.view.rounds]
    assert [{a for a in ats if a[1] >= 0} for ats in views] == [{(0, 0)}, {(1, 0)}, {(1, 1)}, {(2, 0)}, {(2, 1)}]
    # A round's head-to-head profile against the best (slot -1) sits in its candidate's view (decision 0037).
    assert all(a == (v.round, -1) and v.versus is not None
               for v, ats in zip(run.view.rounds, views) for a in ats if a[1] < 0)  # fmt: skip


@pytest.mark.slow
def test_two_candidates_per_round_with_the_llm_team(temporal_server, settings, llm_env):
    script = [design(), diagnosis(), plan(8, "REPEAT 16 -> 8, add instead of multiply"), code(ROUND1_SOURCE),
              plan(4, "REPEAT 16 -> 4"), code(ROUND2_SOURCE)]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, "--candidates", "2"))
    check_common(run, srv)
    assert [role_of(r) for r in srv.requests] == ["test_designer", "analyst", "planner", "coder", "planner", "coder"]
    res = run.result
    assert [(r.round, r.slot) for r in res.rounds] == [(1, 0), (1, 1)]
    assert res.rounds[0].candidate_id != res.rounds[1].candidate_id
    assert all(r.compiled and r.correct for r in res.rounds) and sum(r.accepted for r in res.rounds) == 1
    # The second planner sees the first slot's plan as pending in this round, not as a failure.
    second = srv.requests[4].messages[1]["content"]
    assert "REPEAT 16 -> 8, add instead of multiply" in second
    assert "being evaluated in this round; propose something different" in second and "FAILED" not in second
    # The analyst's diagnosis is shared by both slots; its call is in the first slot's view.
    first_view, second_view = run.view.rounds[1:]
    assert [c.role for c in first_view.llm_calls] == ["analyst", "planner", "coder"]
    assert [c.role for c in second_view.llm_calls] == ["planner", "coder"]
    assert first_view.diagnosis == second_view.diagnosis and second_view.profile.ok
    assert res.usage.llm_calls == 6


# ------------------------------------------------------------------------- (10) single agent


def test_single_agent_with_the_openai_provider(temporal_server, settings, llm_env):
    one = Reply.json({"description": "REPEAT 16 -> 8, add instead of multiply", "rationale": "fewer passes",
                      "tunables": {"REPEAT": 8}, "flags": None, "source": ROUND1_SOURCE, "summary": "s"})
    done = Reply.json({"description": "", "rationale": "nothing left worth trying", "exhausted": True})
    with FakeOpenAI([design(), one, done]) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, "--single-agent", rounds=3))
    check_common(run, srv)
    assert [role_of(r) for r in srv.requests] == ["test_designer", "single_agent", "single_agent"]
    names = [c.activity for c in run.view_calls()]
    assert "analyze" not in names and "plan" not in names and "code" not in names
    assert names.count("single_agent") == 2
    res = run.result
    assert res.stop_reason == "the planner has nothing new to try" and len(res.rounds) == 1
    (record,) = res.rounds
    assert record.accepted and record.speedup_geomean > MIN_SPEEDUP
    view = run.view.rounds[1]
    assert [c.role for c in view.llm_calls] == ["single_agent"] and matches_wire(view.llm_calls[0], srv.requests[1])
    assert "Current source (kernel.cpp)" in view.llm_calls[0].messages[1].content
    assert view.code.candidate.id == record.candidate_id and view.compile.ok and view.profile.ok
    assert res.usage.llm_calls == 3 and run.report().single_agent is True
    last = run.view.rounds[2]  # the exhausted round: a plan, no candidate (not the best's id)
    assert last.plan.exhausted and last.candidate_id is None and last.code is None
    assert [c.role for c in last.llm_calls] == ["single_agent"]


# ------------------------------------------------------------------------- the CLI


@pytest.mark.slow
def test_cli_optimize_with_the_openai_provider(settings, tmp_path):
    reports = tmp_path / "report"
    with FakeOpenAI([design(), *round1()]) as srv:
        # The module's home: its compile and evaluation caches serve this run too (its own dev server).
        env = kopt_env(settings.home, KOPT_OPENAI_BASE_URL=srv.base_url, KOPT_OPENAI_API_KEY_ENV=KEY_ENV,
                       KOPT_OPENAI_TIMEOUT_S="5", KOPT_OPENAI_PRICES=json.dumps(PRICES))
        env[KEY_ENV] = KEY
        proc = subprocess.run([sys.executable, "-m", "frontend.cli", "optimize", str(FIXTURE), "--provider", "openai",
                               "--model", MODEL, "--rounds", "1", "--seed", str(SEED), "--report-dir", str(reports)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test designer added 1 shape(s), rejected 1" in proc.stdout and "round 1:" in proc.stdout
    report = json.loads((reports / "report.json").read_text())
    assert report["model"] == MODEL and report["provider"] == "openai"
    assert report["usage"]["llm_calls"] == 4 and report["usage"]["prompt_tokens"] == 400
    assert report["usage"]["cost_usd"] == pytest.approx(4 * CALL_COST)
    assert [role_of(r) for r in srv.requests] == ["test_designer", "analyst", "planner", "coder"]
    assert all(r.body["model"] == MODEL and r.headers["authorization"] == f"Bearer {KEY}" for r in srv.requests)
    assert KEY not in proc.stdout + proc.stderr and KEY not in (reports / "report.json").read_text()
    assert "#define REPEAT 8" in (reports / "best_kernel.cpp").read_text()


# ------------------------------------------------------------------------- token cost of a 5-round run


@pytest.mark.slow
def test_token_cost_of_a_five_round_run(temporal_server, settings, llm_env, capsys):
    """Usage estimated by the fake server from the real prompt and reply sizes (4 chars per token)."""
    est = dict(prompt_tokens=None, completion_tokens=None)
    rounds = [(8, ROUND1_SOURCE, None), (4, ROUND2_SOURCE, None), (2, source("round 3"), None),
              (1, source("round 4"), None), (None, source("round 5"), ["-O3", "-funroll-loops", "-ffast-math",
                                                                        "-march=native"])]
    script = [design(**est)]
    for i, (repeat, src, flags) in enumerate(rounds, start=1):
        script += [diagnosis(**est), plan(repeat, f"round {i} change", flags, **est), code(src, **est)]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, llm_env, *QUICK, rounds=5))
    check_common(run, srv)
    res = run.result
    assert res.status == "completed" and len(res.rounds) == 5

    rows, chars = [], {}
    for view in run.view.rounds:
        p = sum(c.usage.prompt_tokens for c in view.llm_calls)
        o = sum(c.usage.completion_tokens for c in view.llm_calls)
        rows.append((view.round, len(view.llm_calls), p, o, sum(c.cost_usd for c in view.llm_calls)))
        for c in view.llm_calls:
            chars.setdefault(c.role, []).append((sum(len(m.content) for m in c.messages), len(c.response_text)))
    total = tuple(sum(r[i] for r in rows) for i in range(1, 5))
    assert total[:3] == (res.usage.llm_calls, res.usage.prompt_tokens, res.usage.completion_tokens) == (16, *total[1:3])
    assert total[3] == pytest.approx(res.usage.cost_usd)
    with capsys.disabled():
        print(f"\n5-round run, model {MODEL} at ${PRICE_IN}/${PRICE_OUT} per 1M tokens, "
              f"tokens estimated as chars/4:")
        for rnd, n, p, o, cost in rows:
            print(f"  round {rnd}: {n} calls, {p} tokens in, {o} out, ${cost:.5f}")
        print(f"  total: {total[0]} calls, {total[1]} in, {total[2]} out, ${total[3]:.5f}; wall {run.seconds:.1f}s")
        for role, sizes in chars.items():
            prompts = [s[0] for s in sizes]
            replies = sum(s[1] for s in sizes) / len(sizes)
            print(f"  {role}: {len(sizes)} calls, prompt chars min {min(prompts)} max {max(prompts)} "
                  f"mean {sum(prompts) / len(prompts):.0f}; reply chars mean {replies:.0f}")
    # Each round's planner prompt grows with the history; nothing grows without bound here.
    planner = [s[0] for s in chars["planner"]]
    assert planner == sorted(planner) and math.isfinite(total[3])
