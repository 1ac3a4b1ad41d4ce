"""The `openai` provider and the LLM roles, driven through the real openai client against a
scripted OpenAI-compatible server on 127.0.0.1 (tests/fake_openai.py). No network, a few seconds."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import structlog
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

pytest.importorskip("openai")  # the GPU image has no openai client; CI has

from agents import llm, roles  # noqa: E402
from frontend.client import connect
from kopt.agent_models import (
    AgentCodeRequest,
    AgentPlanRequest,
    AnalyzeRequest,
    Diagnosis,
    LLMCall,
    LLMConfig,
    PlanOutput,
    RoleOverride,
    ShapeProposal,
    SingleAgentRequest,
    TestDesignRequest,
    repair_request,
    shape_symbols,
    validate_shapes,
)
from kopt.artifacts import ArtifactStore
from kopt.candidates import candidate_id, unified_diff
from kopt.llm_settings import LLMSettings, llm_config
from kopt.models import (
    Candidate,
    CodeRequest,
    CompileResult,
    NsightKernel,
    NsightSummary,
    PackageRef,
    Plan,
    PlanRequest,
    ProfileResult,
    RoundRecord,
    Shape,
    ShapeSpeedup,
    ShapeTiming,
)
from kopt.package import load_spec, read_tunables
from kopt.plan_history import compact_history
from kopt.settings import Settings
from tests.conftest import REPO
from tests.fake_openai import Delay, FakeOpenAI, Reply, Status

SILU = REPO / "kernels" / "silu_and_mul"
KEY_ENV = "KOPT_TEST_LLM_KEY"
KEY = "sk-test-DO-NOT-LEAK-5f1e2d3c4b5a"
PRICES = {"m-default": (1.0, 2.0), "m-coder": (3.0, 15.0)}
TOOLCHAIN = "tc"


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    for var in ("KOPT_OPENAI_BASE_URL", "KOPT_OPENAI_MODEL", "KOPT_OPENAI_ROLES", "KOPT_OPENAI_PRICES"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    spec = load_spec(SILU)
    source = (SILU / spec.sources["cuda"]).read_text()
    files = ArtifactStore(tmp_path_factory.mktemp("artifacts")).put_tree(SILU)
    return PackageRef(spec=spec, files=files, baseline_sources={"cuda": source})


@pytest.fixture(scope="module")
def best(pkg):
    source = pkg.baseline_sources["cuda"]
    flags = pkg.spec.build["cuda"].flags
    tunables = read_tunables(source, [t.name for t in pkg.spec.tunables_for("cuda")])
    return Candidate(id=candidate_id(source, flags, TOOLCHAIN), source=source, flags=flags, tunables=tunables)


def config(srv: FakeOpenAI, **kw) -> LLMConfig:
    base = dict(base_url=srv.base_url, model="m-default", api_key_env=KEY_ENV, timeout_s=5, temperature=0.2,
                max_output_tokens=4096, prices=PRICES,
                roles={"coder": RoleOverride(model="m-coder", temperature=0.0)})
    return LLMConfig(**{**base, **kw})


def run(coro):
    return asyncio.run(coro)


def failure(coro) -> ApplicationError:
    with pytest.raises(ApplicationError) as info:
        run(coro)
    return info.value


def edited(source: str, marker: str = "faster") -> str:
    """A plausible coder output: the base source with a change (tunables left as they were)."""
    return f"// {marker}\n{source}"


def plan_request(pkg, best, srv, history=None, **kw) -> AgentPlanRequest:
    return AgentPlanRequest(package=pkg, target="cuda", round=3, best=best, best_speedup=1.07,
                            history=history or [], provider="openai", llm=config(srv), **kw)


def code_request(pkg, best, srv, plan: Plan | None = None) -> AgentCodeRequest:
    plan = plan or Plan(round=1, description="THREADS 256 -> 512 and a comment", rationale="more warps in flight",
                        tunables={**best.tunables, "THREADS": 512}, flags=["-O3", "--use_fast_math"])
    return AgentCodeRequest(package=pkg, target="cuda", toolchain=TOOLCHAIN, plan=plan, base=best,
                            provider="openai", llm=config(srv))


# ---------------------------------------------------------------- a good run per role


def test_design_tests(pkg):
    proposals = {"shapes": [
        {"dims": {"T": 1, "D": 7}, "reason": "D below VEC: scalar path"},
        {"dims": {"T": 0, "D": 8}, "reason": "zero rows"},
        {"dims": {"T": 5}, "reason": "missing D"},
        {"dims": {"T": 3, "D": 13}, "reason": "already in the suite"},
        {"dims": {"T": 70000, "D": 8}, "reason": "above the limit"},
    ], "notes": "remainders against VEC"}
    with FakeOpenAI([Reply.json(proposals, prompt_tokens=1000, completion_tokens=200)]) as srv:
        req = TestDesignRequest(package=pkg, target="cuda", limits={"T": 65536, "D": 16384}, llm=config(srv))
        design, calls = run(roles.design_tests(req))
    assert [s.dims for s in design.shapes] == [p["dims"] for p in proposals["shapes"]]

    review = validate_shapes(design.shapes, shape_symbols(pkg.spec), req.limits, pkg.spec.shapes["cuda"].test)
    assert review.accepted == [Shape(dims={"D": 7, "T": 1})]
    assert len(review.rejected) == 4
    assert any("T=0 is outside [1, 65536]" in r for r in review.rejected)
    assert any("missing D" in r for r in review.rejected)
    assert any("duplicate" in r for r in review.rejected)

    (sent,) = srv.requests
    assert sent.headers["authorization"] == f"Bearer {KEY}"  # the key is sent, and only there
    assert sent.body["model"] == "m-default" and sent.body["temperature"] == 0.2
    assert sent.body["response_format"] == {"type": "json_object"}
    assert sent.body["max_tokens"] == 4096 and sent.body["stream"] is False
    assert pkg.spec.shapes["cuda"].test[-1].label in sent.text and '"T": 65536' in sent.text
    assert f"#define VEC {read_tunables(pkg.baseline_sources['cuda'], ['VEC'])['VEC']}" in sent.text

    (call,) = calls
    assert call.role == "test_designer" and call.attempt == 1 and not call.repair
    assert call.base_url_host == srv.base_url.split("//")[1].split("/")[0]
    assert [m.role for m in call.messages] == ["system", "user"] and call.messages[1].content in sent.text
    assert call.usage.prompt_tokens == 1000 and call.usage.completion_tokens == 200
    assert call.cost_usd == pytest.approx((1000 * 1.0 + 200 * 2.0) / 1e6)
    assert call.output["notes"] == "remainders against VEC" and call.error is None and call.latency_s > 0


def test_analyze(pkg, best):
    ptxas = "ptxas info    : Used 18 registers, 380 bytes cmem[0]"
    profile = ProfileResult(candidate_id=best.id, ok=True, device="NVIDIA H100 80GB HBM3", copy_bandwidth_gbs=3000,
                            timings=[ShapeTiming(shape="T=512,D=14336", dtype="bfloat16", median_us=25.0, p10_us=24.5,
                                                 p90_us=26.0, samples=200, gbytes_per_s=1875.0, pct_sol=62.5)],
                            nsight=NsightSummary(shape="T=512,D=14336", dtype="bfloat16", seconds=7.5, kernels=[
                                NsightKernel(name="silu_kernel", time_us=24.1, dram_pct=81.0, occupancy_pct=45.0,
                                             stalls={"long_scoreboard": 30.2})]))  # fmt: skip
    answer = {"bottleneck": "memory-bound at 62.5% SOL", "evidence": ["1875 GB/s of 3000"],
              "suggestions": ["16-byte loads for odd D"]}
    with FakeOpenAI([Reply.json(answer)]) as srv:
        req = AnalyzeRequest(package=pkg, target="cuda", candidate=best, profile=profile, baseline=profile,
                             compile=CompileResult(candidate_id=best.id, ok=True, seconds=1.0, resource_usage=ptxas),
                             llm=config(srv))
        diagnosis, calls = run(roles.analyze(req))
    assert diagnosis == Diagnosis(**answer)
    prompt = srv.requests[0].text
    assert ptxas in prompt and "62.5% SOL" in prompt and "3000 GB/s" in prompt and "H100" in prompt
    # What Nsight Compute measured, once (the baseline is this candidate here): #27 item 3.
    assert prompt.count("Nsight Compute at T=512,D=14336 bfloat16 (7.5 s):") == 1, prompt
    assert "- silu_kernel: 24.10 us" in prompt and "DRAM 81%" in prompt and "long_scoreboard 30.2" in prompt
    assert "(none yet: this is the first round)" in prompt  # no rounds to show yet
    assert calls[0].role == "analyst"


def test_the_analyst_sees_what_was_rejected_since_the_best(pkg, best):
    """The analyst saw only the best and repeated its previous request word for word (issue #27)."""
    profile = ProfileResult(candidate_id=best.id, ok=True, device="cpu")
    history = [RoundRecord(round=4, candidate_id="c4", description="THREADS 512", tunables={}, flags=[],
                           compiled=True, correct=False, failure="wrong result: T=3,D=13 float16: out: mismatch")]
    with FakeOpenAI([Reply.json({"bottleneck": "memory-bound"})]) as srv:
        run(roles.analyze(AnalyzeRequest(package=pkg, target="cuda", candidate=best, profile=profile,
                                         baseline=profile, llm=config(srv), history=history)))  # fmt: skip
    prompt = srv.requests[0].text
    assert "round 4: THREADS 512" in prompt and "FAILED: wrong result: T=3,D=13 float16: out: mismatch" in prompt


def test_plan_uses_history_and_diagnosis(pkg, best):
    history = [RoundRecord(round=1, candidate_id="c1", description="BLOCKS_PER_ROW 1 -> 2", tunables=best.tunables,
                           flags=best.flags, compiled=True, correct=False,
                           failure="wrong result: T=3,D=13 max_abs_err 0.5"),
               RoundRecord(round=2, candidate_id="c2", description="VEC 4", tunables=best.tunables, flags=best.flags,
                           compiled=True, correct=True, speedup_geomean=1.2, versus_best=0.98,
                           versus_best_ci=[0.96, 1.0],
                           per_shape=[ShapeSpeedup(shape="T=512,D=14336", dtype="bfloat16", baseline_us=30.0,
                                                   candidate_us=25.0, speedup=1.2)])]  # fmt: skip
    diagnosis = Diagnosis(bottleneck="launch-bound at T=512", evidence=["4.1 us of 25 us is launch"])
    answer = {"description": "THREADS 256 -> 512 with fast math", "rationale": "fewer blocks; cheaper exp",
              "tunables": {"THREADS": 512}, "flags": ["-O3", "--use_fast_math"]}
    with FakeOpenAI([Reply.json(answer)]) as srv:
        plan, calls = run(roles.plan(plan_request(pkg, best, srv, history, diagnosis=diagnosis)))
    assert plan == Plan(round=3, description=answer["description"], rationale=answer["rationale"],
                        tunables={**best.tunables, "THREADS": 512}, flags=["-O3", "--use_fast_math"])
    prompt = srv.requests[0].text
    assert "max_abs_err 0.5" in prompt and "launch-bound at T=512" in prompt and "1.070x" in prompt
    assert "(25.0 us vs baseline 30.0 us)" in prompt  # absolute times, not ratios alone
    assert "head to head against the best then: 0.980x [0.960, 1.000]" in prompt
    assert "--ptxas-options=-dlcm=cg" in prompt  # the playbook is offered as hints
    assert calls[0].role == "planner" and calls[0].output["tunables"] == {"THREADS": 512}


def test_plan_prompt_shows_older_rounds_in_brief(pkg, best):
    """A long run's prompt: the digest of older rounds (bounded) before the recent records in full."""
    records = [RoundRecord(round=r, candidate_id=f"c{r}", description=f"unroll by {r}", tunables={"THREADS": r},
                           flags=best.flags, compiled=r % 3 != 0, correct=r % 3 != 0,
                           speedup_geomean=1 + r / 1000 if r % 3 else None,
                           failure=None if r % 3 else "compile error: kernel.cu:7: error: bad unroll")
               for r in range(1, 301)]
    recent, earlier = compact_history(records)
    with FakeOpenAI([Reply.json({"description": "d", "rationale": "r"})]) as srv:
        run(roles.plan(plan_request(pkg, best, srv, recent, earlier=earlier)))
    prompt = srv.requests[0].text
    assert "failed 93x: compile error: kernel.cu:7: error: bad unroll" in prompt
    assert "fastest: round 280: unroll by 280" in prompt  # the fastest older result, with its description
    assert f"tried THREADS=280|{' '.join(sorted(best.flags))}: 1.280x" in prompt
    assert prompt.count("- tried ") == roles.EARLIER_CONFIGS  # the most recent ones; the count of the rest
    assert f"{280 - roles.EARLIER_CONFIGS} older configurations not shown" in prompt
    assert "round 300: unroll by 300" in prompt and "round 220:" not in prompt.split("in full")[1]


def test_plan_keeps_best_flags_when_null_and_can_say_exhausted(pkg, best):
    with FakeOpenAI([Reply.json({"description": "restructure the row loop", "rationale": "r", "flags": None}),
                     Reply.json({"description": "", "rationale": "all tried", "exhausted": True})]) as srv:
        plan, _ = run(roles.plan(plan_request(pkg, best, srv)))
        done, _ = run(roles.plan(plan_request(pkg, best, srv)))
    assert plan.flags == best.flags and plan.tunables == best.tunables and not plan.exhausted
    assert done.exhausted


def test_plain_plan_request_uses_the_workers_settings(pkg, best, monkeypatch):
    with FakeOpenAI([Reply.json({"description": "d", "rationale": "r"})]) as srv:
        monkeypatch.setenv("KOPT_OPENAI_BASE_URL", srv.base_url)
        monkeypatch.setenv("KOPT_OPENAI_MODEL", "m-env")
        monkeypatch.setenv("KOPT_OPENAI_API_KEY_ENV", KEY_ENV)
        monkeypatch.setenv("KOPT_OPENAI_ROLES", '{"planner": {"temperature": 0.7}}')
        req = PlanRequest(package=pkg, target="cuda", round=1, best=best, best_speedup=1.0, history=[])
        plan, calls = run(roles.plan(req))
    assert plan.description == "d"
    assert srv.requests[0].body["model"] == "m-env" and srv.requests[0].body["temperature"] == 0.7
    assert calls[0].cost_usd is None  # m-env has no price


def test_code(pkg, best):
    new_source = edited(best.source)
    with FakeOpenAI([Reply.json({"source": new_source, "summary": "comment"}, prompt_tokens=3000,
                                completion_tokens=2500)]) as srv:
        req = code_request(pkg, best, srv)
        result, calls = run(roles.code(req))
    cand = result.candidate
    # The plan's tunable values are applied to whatever the coder wrote.
    assert read_tunables(cand.source, ["THREADS"]) == {"THREADS": 512}
    assert cand.source == new_source.replace(f"#define THREADS {best.tunables['THREADS']}", "#define THREADS 512")
    assert cand.id == candidate_id(cand.source, ["-O3", "--use_fast_math"], TOOLCHAIN)
    assert cand.flags == ["-O3", "--use_fast_math"] and cand.tunables == req.plan.tunables
    assert cand.parent_id == best.id and cand.origin == req.plan.description
    assert result.diff == unified_diff(best.source, cand.source, "kernel.cu") and "+// faster" in result.diff
    sent = srv.requests[0]
    assert sent.body["model"] == "m-coder" and sent.body["temperature"] == 0.0  # per-role override
    assert "THREADS 256 -> 512 and a comment" in sent.text and best.source.strip() in sent.text
    assert calls[0].cost_usd == pytest.approx((3000 * 3.0 + 2500 * 15.0) / 1e6)


def test_single_agent(pkg, best):
    answer = {"description": "VEC 8 -> 4", "rationale": "r", "tunables": {"VEC": 4}, "flags": None,
              "source": edited(best.source, "single"), "summary": "s"}
    done_reply = Reply.json({"description": "", "rationale": "done", "exhausted": True})
    with FakeOpenAI([Reply.json(answer), done_reply]) as srv:
        req = SingleAgentRequest(package=pkg, target="cuda", round=2, best=best, best_speedup=1.0, history=[],
                                 toolchain=TOOLCHAIN, llm=config(srv))
        plan, result, calls = run(roles.single_agent(req))
        done, unchanged, _ = run(roles.single_agent(req))
    assert plan.tunables["VEC"] == 4 and plan.flags == best.flags
    assert "#define VEC 4" in result.candidate.source and "// single" in result.candidate.source
    assert result.candidate.id == candidate_id(result.candidate.source, best.flags, TOOLCHAIN)
    assert calls[0].role == "single_agent" and "Current source (kernel.cu)" in srv.requests[0].text
    assert done.exhausted and unchanged.candidate == best and unchanged.diff == ""


# ---------------------------------------------------------------- invalid output, one repair turn


def test_malformed_json_is_repaired_once(pkg, best):
    broken = '{"source": "#include <climits>\n'  # cut off mid-string
    good = {"source": edited(best.source), "summary": "s"}
    with FakeOpenAI([Reply.raw(broken, prompt_tokens=500, completion_tokens=10),
                     Reply.json(good, prompt_tokens=700, completion_tokens=300)]) as srv:
        result, calls = run(roles.code(code_request(pkg, best, srv)))
    assert "// faster" in result.candidate.source
    first, second = calls
    assert first.attempt == 1 and not first.repair and first.response_text == broken
    assert first.error.startswith("not valid JSON") and first.output is None
    assert second.attempt == 2 and second.repair and second.error is None and second.output is not None
    # The repair turn replays the conversation plus the bad reply and what was wrong with it.
    repair_msgs = srv.requests[1].messages
    assert repair_msgs[:2] == srv.requests[0].messages
    assert repair_msgs[2] == {"role": "assistant", "content": broken}
    assert repair_msgs[3]["role"] == "user" and "not valid JSON" in repair_msgs[3]["content"]
    assert (sum(c.usage.prompt_tokens for c in calls), sum(c.usage.completion_tokens for c in calls)) == (1200, 310)
    assert sum(c.cost_usd for c in calls) == pytest.approx((1200 * 3.0 + 310 * 15.0) / 1e6)


def test_schema_error_is_sent_back(pkg, best):
    with FakeOpenAI([Reply.json({"description": "x", "rationale": "y", "tunables": {"WARPS": 4, "VEC": 3}}),
                     Reply.json({"description": "x", "rationale": "y", "tunables": {"VEC": 4}})]) as srv:
        plan, calls = run(roles.plan(plan_request(pkg, best, srv)))
    assert plan.tunables["VEC"] == 4
    feedback = srv.requests[1].messages[-1]["content"]
    assert "'WARPS' is not declared" in feedback and "VEC=3 is not an allowed value" in feedback
    assert calls[0].error and calls[1].output["tunables"] == {"VEC": 4}


def test_empty_replies_are_unusable_and_go_back_to_the_model(pkg, best):
    """A test design of `{"type": "object"}` was accepted as a valid design of 0 shapes; a diagnosis with
    an empty bottleneck and a plan without a rationale are as empty. Each goes back once, like a schema
    error, with what is missing."""
    profile = ProfileResult(candidate_id=best.id, ok=True, device="cpu")
    cases = [
        (lambda srv: roles.design_tests(TestDesignRequest(package=pkg, target="cuda", limits={"T": 64, "D": 64},
                                                          llm=config(srv))),
         {"type": "object"}, {"shapes": [], "notes": "the suite covers every remainder"}, "no shapes and no notes"),
        (lambda srv: roles.analyze(AnalyzeRequest(package=pkg, target="cuda", candidate=best, profile=profile,
                                                  baseline=profile, llm=config(srv))),
         {"bottleneck": "  "}, {"bottleneck": "launch-bound"}, "bottleneck is empty"),
        (lambda srv: roles.plan(plan_request(pkg, best, srv)),
         {"description": "VEC 4", "rationale": "", "tunables": {"VEC": 4}},
         {"description": "VEC 4", "rationale": "16-byte loads", "tunables": {"VEC": 4}}, "rationale is empty"),
    ]  # fmt: skip
    for call, empty, usable, said in cases:
        with FakeOpenAI([Reply.json(empty), Reply.json(usable)]) as srv:
            _, calls = run(call(srv))
        assert len(srv.requests) == 2 and said in srv.requests[1].messages[-1]["content"], said
        assert calls[0].error and calls[1].error is None


def test_fenced_json_is_accepted_without_a_repair(pkg, best):
    text = "Here you go:\n```json\n" + json.dumps({"bottleneck": "b"}) + "\n```"
    with FakeOpenAI([Reply.raw(text)]) as srv:
        req = AnalyzeRequest(package=pkg, target="cuda", candidate=best,
                             profile=ProfileResult(candidate_id=best.id, ok=True), llm=config(srv))
        diagnosis, calls = run(roles.analyze(req))
    assert diagnosis.bottleneck == "b" and len(calls) == 1


def test_malformed_twice_is_a_final_output_invalid_with_whole_records(pkg, best):
    """No retry fixes an unusable reply: the error is final, so its audit records ride along whole (a
    retryable one carried compact records: no prompt, 300 characters of the reply; found against
    llama.cpp's server, tests/test_local_model.py)."""
    with FakeOpenAI([Reply.raw("not json at all"), Reply.json({"summary": "no source field"})]) as srv:
        err = failure(roles.code(code_request(pkg, best, srv)))
    assert err.type == "LLMOutputInvalid" and err.non_retryable
    assert "source: Field required" in err.message
    calls = [LLMCall.model_validate(d) for d in err.details]  # the audit records ride along into history
    assert [c.attempt for c in calls] == [1, 2] and all(c.error for c in calls)
    assert all(c.messages for c in calls) and calls[0].response_text == "not json at all"
    assert sum(c.usage.prompt_tokens for c in calls) == 200


def test_coder_must_keep_the_tunable_defines(pkg, best):
    no_define = best.source.replace(f"#define THREADS {best.tunables['THREADS']}\n", "")
    assert no_define != best.source
    with FakeOpenAI([Reply.json({"source": no_define}), Reply.json({"source": best.source})]) as srv:
        err = failure(roles.code(code_request(pkg, best, srv, Plan(round=1, description="d", rationale="r",
                                                                    tunables=best.tunables, flags=best.flags))))
    assert err.type == "LLMOutputInvalid"
    assert "THREADS" in srv.requests[1].messages[-1]["content"]  # first: missing define
    assert "identical to the current one" in err.message  # second: no change at all


@pytest.mark.parametrize("reply", [Reply.refused("I can't help with that."), Reply.filtered()],
                         ids=["refusal", "content_filter"])
def test_refusal_is_not_retryable(pkg, best, reply):
    with FakeOpenAI([reply]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMRefused" and err.non_retryable
    assert len(srv.requests) == 1  # no repair turn for a refusal
    assert LLMCall.model_validate(err.details[0]).error.startswith("refused")


# ---------------------------------------------------------------- HTTP and transport errors


def test_rate_limit_is_retryable_with_the_servers_delay(pkg, best):
    with FakeOpenAI([Status(429, {"Retry-After": "7"}, "Rate limit reached")]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMRateLimited" and not err.non_retryable
    assert err.next_retry_delay == timedelta(seconds=7)
    assert len(srv.requests) == 1  # the client does not retry: Temporal does
    assert "Rate limit reached" in err.message
    assert LLMCall.model_validate(err.details[0]).error.startswith("LLMRateLimited")


def test_server_error_is_retryable(pkg, best):
    with FakeOpenAI([Status(500), Status(503, {"Retry-After": "2"})]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
        err503 = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMServerError" and not err.non_retryable
    assert err.next_retry_delay is None  # no Retry-After: the activity's retry policy says when
    assert err503.next_retry_delay == timedelta(seconds=2)
    assert len(srv.requests) == 2


@pytest.mark.parametrize("status", [401, 403])
def test_auth_error_is_not_retryable_and_names_the_key_setting(pkg, best, status):
    # Some servers echo the key they were given; it must not reach the error.
    with FakeOpenAI([Status(status, message=f"Incorrect API key provided: {KEY}")]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMAuthError" and err.non_retryable
    assert "KOPT_OPENAI_API_KEY_ENV" in err.message and KEY_ENV in err.message
    assert KEY not in err.message and KEY not in json.dumps(list(err.details))


@pytest.mark.parametrize("body, said", [
    ({"detail": "Invalid token for this deployment"}, "Invalid token for this deployment"),  # FastAPI servers
    ({"message": "key expired"}, "key expired"),
    ({"error": "unauthorized: no such key"}, "unauthorized: no such key"),
    ({"error": {"code": 40101}}, '"code": 40101'),
])  # fmt: skip
def test_an_error_body_of_another_shape_keeps_its_detail(pkg, best, body, said):
    """A 401 whose body is {"detail": ...} was reported as just "Error code: 401."."""
    with FakeOpenAI([Status(401, body=body)]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMAuthError" and said in err.message, err.message


def test_not_found_names_the_model_and_base_url_settings(pkg, best):
    with FakeOpenAI([Status(404, message="The model `m-default` does not exist")]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMNotFound" and err.non_retryable
    assert "KOPT_OPENAI_MODEL" in err.message and "KOPT_OPENAI_BASE_URL" in err.message
    assert "'m-default'" in err.message and "does not exist" in err.message


def test_bad_request_is_not_retryable(pkg, best):
    with FakeOpenAI([Status(400, message="Unsupported parameter: 'max_tokens'")]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMBadRequest" and err.non_retryable
    assert "KOPT_OPENAI_MAX_TOKENS_PARAM" in err.message and "Unsupported parameter" in err.message


def test_timeout_is_retryable(pkg, best):
    with FakeOpenAI([Delay(10)]) as srv:
        req = plan_request(pkg, best, srv).model_copy(update={"llm": config(srv, timeout_s=0.3)})
        start = time.monotonic()
        err = failure(roles.plan(req))
    assert time.monotonic() - start < 5
    assert err.type == "LLMTimeout" and not err.non_retryable and "KOPT_OPENAI_TIMEOUT_S" in err.message
    # Which setting to raise, and to what (#27 item 5): twice the timeout that was too short.
    assert "raise KOPT_OPENAI_TIMEOUT_S to 0.6 or more" in err.message, err.message


def test_a_reply_cut_off_twice_says_which_setting_to_raise_and_to_what(pkg, best):
    """#27 item 5: a reply that ends at the output-token limit, again after the repair turn, fails its
    candidate naming KOPT_OPENAI_MAX_OUTPUT_TOKENS and a value that would have room (twice the limit)."""
    cut = Reply.raw('{"description": "REPEAT', finish_reason="length")
    with FakeOpenAI([cut, cut]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
    assert err.type == "LLMOutputInvalid", err
    assert "cut off at 4096 tokens (if it repeats, raise KOPT_OPENAI_MAX_OUTPUT_TOKENS to 8192 or more)" in err.message


def test_connection_error_is_retryable(pkg, best):
    with FakeOpenAI() as srv:
        dead = srv.base_url
    req = plan_request(pkg, best, srv).model_copy(update={"llm": LLMConfig(base_url=dead, api_key_env=KEY_ENV)})
    err = failure(roles.plan(req))
    assert err.type == "LLMConnectionError" and not err.non_retryable


def test_missing_key_variable_is_not_retryable_and_sends_nothing(pkg, best, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with FakeOpenAI([Reply.json({"description": "d", "rationale": "r"})]) as srv:
        err = failure(roles.plan(plan_request(pkg, best, srv)))
        assert not srv.requests
        # An endpoint without auth (vLLM, Ollama): an empty api_key_env sends a placeholder.
        req = plan_request(pkg, best, srv).model_copy(update={"llm": config(srv, api_key_env="")})
        run(roles.plan(req))
    assert err.type == "LLMConfigError" and err.non_retryable and KEY_ENV in err.message
    assert srv.requests[0].headers["authorization"] == "Bearer no-key"


# ---------------------------------------------------------------- compile repair


def test_compile_failure_gets_one_repair_turn(pkg, best):
    broken = best.source + "\nthis line is not C++\n"
    fixed = edited(best.source, "fixed")
    compiler = "kernel.cu(44): error: expected an expression\n1 error detected in the compilation of \"kernel.cu\"."
    script = [Reply.json({"source": broken, "summary": "s"}), Reply.json({"source": fixed, "summary": "f"})]
    with FakeOpenAI(script) as srv:
        req = code_request(pkg, best, srv)
        coded, _ = run(roles.code(req))
        compiled = CompileResult(candidate_id=coded.candidate.id, ok=False, seconds=0.5, log_tail=compiler)
        repaired, calls = run(roles.repair(repair_request(req, coded.candidate, compiled)))
    prompt = srv.requests[1].text
    assert compiler in prompt  # the compiler's error
    assert "this line is not C++" in prompt  # the failed version
    assert repaired.candidate.source == fixed.replace(f"#define THREADS {best.tunables['THREADS']}",
                                                      "#define THREADS 512")
    assert repaired.candidate.parent_id == best.id and repaired.candidate.id != coded.candidate.id
    assert repaired.diff == unified_diff(best.source, repaired.candidate.source, "kernel.cu")
    assert calls[0].role == "repair" and srv.requests[1].body["model"] == "m-coder"  # inherits the coder's model


def test_repair_request_keeps_the_tail_of_a_long_log(pkg, best):
    req = CodeRequest(package=pkg, target="cuda", toolchain=TOOLCHAIN, base=best,
                      plan=Plan(round=1, description="d", rationale="r", tunables=best.tunables, flags=best.flags))
    rr = repair_request(req, best, "x" * 10_000 + "LAST LINE")
    assert rr.compile_error.endswith("LAST LINE") and len(rr.compile_error) < 6100
    assert rr.failed == best and rr.plan == req.plan and rr.llm is None


# ---------------------------------------------------------------- secrets


def test_api_key_never_in_audit_records_or_logs(pkg, best, caplog, capsys):
    caplog.set_level(logging.DEBUG)  # the openai and http client loggers included
    records: list[LLMCall] = []
    errors: list[ApplicationError] = []
    with structlog.testing.capture_logs() as events:
        with FakeOpenAI([Reply.raw("{"), Reply.json({"description": "d", "rationale": "r"}),
                         Status(401, message=f"bad key {KEY}"), Status(429, {"Retry-After": "1"}, f"slow down {KEY}"),
                         Reply.raw(f"echo {KEY}"), Reply.raw(f"again {KEY}")]) as srv:
            _, calls = run(roles.plan(plan_request(pkg, best, srv)))
            records += calls
            for _ in range(3):
                try:
                    run(roles.plan(plan_request(pkg, best, srv)))
                except ApplicationError as err:
                    errors.append(err)
                    records += [LLMCall.model_validate(d) for d in err.details]
    assert srv.requests and all(r.headers["authorization"] == f"Bearer {KEY}" for r in srv.requests)
    assert len(records) == 6 and len(errors) == 3
    dumped = json.dumps([r.model_dump(mode="json") for r in records])
    assert KEY not in dumped and "***" in dumped  # the echoed key was scrubbed from the reply text
    assert all(KEY not in e.message for e in errors)
    assert KEY not in caplog.text
    out = capsys.readouterr()
    assert KEY not in out.out and KEY not in out.err
    assert events and KEY not in json.dumps(events, default=str)
    allowed = {"event", "log_level", "role", "model", "prompt_tokens", "completion_tokens", "latency_s", "error"}
    assert all(set(e) <= allowed for e in events)
    assert LLMConfig.model_fields.keys().isdisjoint({"api_key", "key"})


# ---------------------------------------------------------------- settings and pure helpers


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("KOPT_OPENAI_BASE_URL", "http://vllm:8000/v1")
    monkeypatch.setenv("KOPT_OPENAI_MODEL", "qwen")
    monkeypatch.setenv("KOPT_OPENAI_API_KEY_ENV", KEY_ENV)
    monkeypatch.setenv("KOPT_OPENAI_TIMEOUT_S", "30")
    monkeypatch.setenv("KOPT_OPENAI_ROLES",
                       '{"coder": {"model": "big", "temperature": 0}, "analyst": {"temperature": 1}}')
    monkeypatch.setenv("KOPT_OPENAI_PRICES", '{"qwen": [0.1, 0.2]}')
    cfg = llm_config(LLMSettings())
    assert cfg.base_url == "http://vllm:8000/v1" and cfg.timeout_s == 30 and cfg.prices == {"qwen": (0.1, 0.2)}
    assert cfg.for_role("planner") == ("qwen", 0.2)
    assert cfg.for_role("coder") == ("big", 0.0)
    assert cfg.for_role("repair") == ("big", 0.0)  # falls back to the coder's override
    assert cfg.for_role("analyst") == ("qwen", 1.0)
    assert KEY not in cfg.model_dump_json()
    assert cfg.cost_usd("qwen", 1_000_000, 500_000) == pytest.approx(0.2)
    monkeypatch.setenv("KOPT_OPENAI_TEMPERATURE", "none")  # send no temperature at all
    assert LLMSettings().temperature is None


def test_request_options_follow_the_config(pkg, best):
    with FakeOpenAI([Reply.json({"description": "d", "rationale": "r"})]) as srv:
        cfg = config(srv, temperature=None, json_mode=False, max_tokens_param="max_completion_tokens")
        run(roles.plan(plan_request(pkg, best, srv).model_copy(update={"llm": cfg})))
    body = srv.requests[0].body
    assert "temperature" not in body and "response_format" not in body and "max_tokens" not in body
    assert body["max_completion_tokens"] == 4096


def test_retry_after_parsing():
    now = datetime(2026, 11, 21, 12, 0, 0, tzinfo=timezone.utc)
    assert llm.retry_after_seconds({"Retry-After": "7"}) == 7
    assert llm.retry_after_seconds({"retry-after": "1.5"}) == 1.5
    assert llm.retry_after_seconds({"retry-after-ms": "250", "retry-after": "7"}) == 0.25
    assert llm.retry_after_seconds({"Retry-After": "Sat, 21 Nov 2026 12:00:30 GMT"}, now=now) == 30
    assert llm.retry_after_seconds({"Retry-After": "-3"}) == 0
    assert llm.retry_after_seconds({"Retry-After": "999999"}) == llm.MAX_RETRY_AFTER_S
    assert llm.retry_after_seconds({"Retry-After": "soon"}) is None
    assert llm.retry_after_seconds({}) is None


@pytest.mark.parametrize(("status", "retryable", "kind"), [
    (400, False, "LLMBadRequest"), (401, False, "LLMAuthError"), (403, False, "LLMAuthError"),
    (404, False, "LLMNotFound"), (408, True, "LLMServerError"), (409, True, "LLMServerError"),
    (422, False, "LLMBadRequest"), (429, True, "LLMRateLimited"), (500, True, "LLMServerError"),
    (502, True, "LLMServerError"), (503, True, "LLMServerError"),
])
def test_status_mapping(status, retryable, kind):
    err = llm.http_error(status, detail="d", retry_after=None, cfg=LLMConfig(), role="planner", model="m")
    assert (not err.non_retryable, err.type) == (retryable, kind)
    assert err.next_retry_delay is None  # when to retry is the activity's retry policy


def test_only_a_servers_retry_after_overrides_the_retry_policy():
    err = llm.http_error(429, detail="d", retry_after=7.5, cfg=LLMConfig(), role="planner", model="m")
    assert err.next_retry_delay == timedelta(seconds=7.5) and "retry after 7.5s" in err.message


def test_small_helpers():
    assert llm.base_url_host("https://user:pw@example.com:8443/openai/v1?api-version=1") == "example.com:8443"
    assert llm.redact_url("https://user:pw@example.com/v1?k=secret") == "https://example.com/v1"
    assert roles.check_flags(["-O3", "--use_fast_math", "-lineinfo", "--ptxas-options=-dlcm=cg", "-march=native"]) == []
    bad = roles.check_flags(["-o/tmp/x", "-Xptxas -v", "@args", "-I/etc", "O3", "-Wl,-rpath,/x", "-ccbin=/bin/sh",
                             "-Xcompiler=-Wl,-rpath,/x", "--compiler-options=-include/etc/passwd"])
    assert len(bad) == 9
    assert roles.strip_fences("```cuda\nint x;\n```\n") == "int x;\n"
    assert roles.strip_fences("int x;") == "int x;\n"
    assert llm.extract_json('noise {"a": 1} noise') == {"a": 1}
    with pytest.raises(ValueError, match="not valid JSON"):
        llm.extract_json("{nope")


def test_validate_shapes_rules(pkg):
    symbols = shape_symbols(pkg.spec)
    assert symbols == ["D", "T"]
    proposals = [ShapeProposal(dims={"T": 2, "D": 5}), ShapeProposal(dims={"T": 2, "D": 5}),
                 ShapeProposal(dims={"T": 2, "D": 5, "E": 1}), ShapeProposal(dims={"T": 2, "D": 100})]
    review = validate_shapes(proposals, symbols, {"T": 10, "D": 50})
    assert [s.dims for s in review.accepted] == [{"D": 5, "T": 2}]
    assert ["duplicate" in r for r in review.rejected] == [True, False, False]
    assert "unknown symbol E" in review.rejected[1] and "D=100 is outside [1, 50]" in review.rejected[2]
    with pytest.raises(ValueError):
        ShapeProposal.model_validate({"dims": {"T": "4", "D": 1.5}})  # strict ints only


def test_agent_models_import_stays_light():
    """kopt.agent_models goes into the workflow sandbox: no openai, no HTTP client, no settings I/O."""
    code = ("import sys, kopt.agent_models; "
            "bad = [m for m in ('openai', 'httpx', 'httpx2', 'pydantic_settings', 'structlog', 'agents') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unknown_role_in_settings_is_rejected(monkeypatch):
    monkeypatch.setenv("KOPT_OPENAI_ROLES", '{"planer": {"model": "x"}}')
    with pytest.raises(ValueError, match="unknown roles"):
        LLMSettings()
    assert LLMConfig(timeout_s=100).activity_timeout() == timedelta(seconds=230)


def test_placeholder_keys_are_not_scrubbed_from_replies(pkg, best, monkeypatch):
    """vLLM-style dummy keys ("EMPTY") are no secret; scrubbing them would corrupt the source."""
    monkeypatch.setenv(KEY_ENV, "EMPTY")
    source = edited(best.source, "EMPTY slots are skipped")
    with FakeOpenAI([Reply.json({"source": source})]) as srv:
        result, calls = run(roles.code(code_request(pkg, best, srv)))
    assert "// EMPTY slots are skipped" in result.candidate.source and "EMPTY" in calls[0].response_text


# ---------------------------------------------------------------- through Temporal


@activity.defn(name="llm_plan_probe")
async def llm_plan_probe(req: AgentPlanRequest) -> PlanOutput:
    plan, calls = await roles.plan(req)
    return PlanOutput(plan=plan, calls=calls)


@workflow.defn(name="LLMPlanProbe", sandboxed=False)  # test-local; the sandbox is checked by the import test
class LLMPlanProbe:
    @workflow.run
    async def run(self, req: AgentPlanRequest) -> PlanOutput:
        # A long initial interval: only the server's Retry-After can make the retry come quickly.
        policy = RetryPolicy(initial_interval=timedelta(seconds=60), maximum_attempts=3)
        return await workflow.execute_activity("llm_plan_probe", req, task_queue=workflow.info().task_queue,
                                               start_to_close_timeout=req.llm.activity_timeout(),
                                               heartbeat_timeout=timedelta(seconds=1),
                                               retry_policy=policy, result_type=PlanOutput)


async def _probe(server, req: AgentPlanRequest):
    client = await connect(server.address, Settings())
    queue = f"llm-probe-{uuid.uuid4()}"
    async with Worker(client, task_queue=queue, workflows=[LLMPlanProbe], activities=[llm_plan_probe]):
        handle = await client.start_workflow("LLMPlanProbe", req, id=queue, task_queue=queue, result_type=PlanOutput)
        try:
            return await handle.result(), await handle.fetch_history()
        except WorkflowFailureError as exc:
            return exc, await handle.fetch_history()


@pytest.mark.slow
def test_temporal_retries_after_the_servers_delay_heartbeats_and_stops_on_auth_errors(temporal_server, pkg, best):
    good = {"description": "THREADS 256 -> 512", "rationale": "r", "tunables": {"THREADS": 512}}
    # The good reply takes longer than the heartbeat timeout: the activity must heartbeat meanwhile.
    with FakeOpenAI([Status(429, {"Retry-After": "1"}), Reply.json(good, delay_s=2.5),
                     Status(401, message=f"Incorrect API key provided: {KEY}")]) as srv:
        start = time.monotonic()
        out, history = asyncio.run(_probe(temporal_server, plan_request(pkg, best, srv)))
        elapsed = time.monotonic() - start
        failed, failed_history = asyncio.run(_probe(temporal_server, plan_request(pkg, best, srv)))

    assert isinstance(out, PlanOutput) and out.plan.tunables["THREADS"] == 512
    assert out.calls[0].usage.prompt_tokens == 100 and out.calls[0].messages  # audit records in the result
    started = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED]
    assert started[-1].activity_task_started_event_attributes.attempt == 2
    assert 3.5 <= elapsed < 30  # the 429's Retry-After (1 s), not the policy's 60 s; then a 2.5 s reply

    assert isinstance(failed, WorkflowFailureError) and isinstance(failed.cause, ActivityError)
    cause = failed.cause.cause
    assert isinstance(cause, ApplicationError) and cause.type == "LLMAuthError" and cause.non_retryable
    assert "KOPT_OPENAI_API_KEY_ENV" in cause.message
    assert LLMCall.model_validate(cause.details[0]).error.startswith("LLMAuthError")  # the record is in history
    assert len(srv.requests) == 3  # one 401, no retry
    for h in (history, failed_history):
        assert KEY not in h.to_json()


def test_connect_gives_up_at_once_on_an_address_no_wait_can_fix():
    """Only a server still starting is waited for; a malformed address fails in well under a second."""
    from temporalio.service import RPCError, RPCStatusCode

    from frontend.client import connect, warming_up
    from kopt.settings import Settings

    start = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot connect to Temporal at localhost:99999"):
        asyncio.run(connect("localhost:99999", Settings()))
    assert time.monotonic() - start < 2.0
    assert warming_up(RuntimeError("Failed client connect: Server connection error: tcp connect error"))
    assert warming_up(RuntimeError("Failed client connect: `get_system_info` call error after connection: Status { "
                                   'code: Unavailable, message: "Frontend is not healthy yet" }'))
    assert warming_up(RPCError("x", RPCStatusCode.UNAVAILABLE, b""))
    assert not warming_up(RPCError("x", RPCStatusCode.PERMISSION_DENIED, b""))
    assert not warming_up(RuntimeError("something else"))
