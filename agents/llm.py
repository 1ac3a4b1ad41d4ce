"""Provider `openai`: one JSON-mode chat-completions call, one repair turn, errors for Temporal.

Any OpenAI-compatible endpoint (OpenAI, Azure OpenAI v1, vLLM, SGLang, Ollama). The client runs
with `max_retries=0` and an explicit timeout: Temporal's retry policy owns retries, so every
failure becomes an ApplicationError that says whether a retry can help (429/5xx/timeouts: yes;
other 4xx and refusals: no, with the setting to fix). When to retry is the activity's retry policy
(kopt/activity_table.py), except where the server said it with Retry-After: that becomes the
error's `next_retry_delay`. The API key is read from the environment inside the call and never leaves it: it is
scrubbed from every text that goes into an audit record, an error or a log line.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import re
import string
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta, timezone
from functools import cache
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import openai
import structlog
from pydantic import BaseModel, ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from agents import reply_cache
from kopt.agent_models import (  # noqa: F401 - the error types are part of this module's interface
    AUTH,
    BAD_REQUEST,
    CONFIG,
    CONNECTION,
    NOT_FOUND,
    OUTPUT_INVALID,
    RATE_LIMITED,
    REFUSED,
    SERVER_ERROR,
    TIMEOUT,
    LLMCall,
    LLMConfig,
    LLMMessage,
    LLMUsage,
    setting_name,
)
from kopt.redact import redact

PROMPTS = Path(__file__).parent / "prompts"
NO_KEY = "no-key"  # sent when api_key_env is empty: servers without auth ignore it
MAX_RETRY_AFTER_S = 3600.0
DETAIL_CHARS = 300
# A reply longer than this is not a usable answer (a code reply is a few KB): it fails like invalid
# JSON, and only its first MAX_REPLY_CHARS go into history and into the repair turn, so no reply
# size can break Temporal's payload limits.
MAX_REPLY_CHARS = 100_000

T = TypeVar("T", bound=BaseModel)
R = TypeVar("R")


def _log():
    return structlog.get_logger("kopt.agents.llm")


# ---------------------------------------------------------------- prompts


@cache
def _read(name: str) -> str:
    return (PROMPTS / f"{name}.md").read_text()


@cache
def _template(name: str) -> tuple[str, str]:
    """A prompt file's (system, user) parts, split at its `# system` and `# user` lines."""
    text = _read(name)
    parts: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.strip() in ("# system", "# user"):
            current = line.strip()[2:]
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    if "user" not in parts:
        raise ValueError(f"{PROMPTS / name}.md: no '# user' section")
    return "\n".join(parts.get("system", [])).strip(), "\n".join(parts["user"]).strip()


def render(prompt: str, /, **values: Any) -> list[LLMMessage]:
    """System and user messages of agents/prompts/<prompt>.md, with `${name}` values filled in."""
    common = _read("system").strip()
    system, user = _template(prompt)
    fill = {k: str(v) for k, v in values.items()}
    system = "\n\n".join(p for p in (common, string.Template(system).substitute(fill)) if p)
    return [LLMMessage(role="system", content=system),
            LLMMessage(role="user", content=string.Template(user).substitute(fill))]


def schema_text(model: type[BaseModel]) -> str:
    """The model's JSON schema, compact and without the auto-generated titles."""
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))}
        return [strip(v) for v in node] if isinstance(node, list) else node

    return json.dumps(strip(model.model_json_schema()))


# ---------------------------------------------------------------- pure helpers


def base_url_host(url: str) -> str:
    """host[:port] of a base URL: what an audit record may keep of it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{host}:{parts.port}" if parts.port else host


def redact_url(url: str) -> str:
    """A base URL without credentials or query, for messages."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{base_url_host(url)}{parts.path}"


MIN_SECRET_CHARS = 8  # shorter "keys" are placeholders (vLLM's "EMPTY"); replacing them would mangle text


def scrub(text: str | None, secret: str | None) -> str | None:
    """`text` with every occurrence of the secret replaced by ***, and anything else secret-shaped
    (kopt.redact: other keys in the environment, provider key formats, private keys) redacted."""
    if text is None:
        return text
    if secret and len(secret) >= MIN_SECRET_CHARS:
        text = text.replace(secret, "***")
    return redact(text)


def retry_after_seconds(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """The server's requested delay: `retry-after-ms`, or `retry-after` as seconds or HTTP date."""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        if "retry-after-ms" in lower:
            return min(max(float(lower["retry-after-ms"]) / 1000, 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        pass
    value = lower.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def is_retryable_status(status: int) -> bool:
    """Statuses a later attempt can fix: rate limits, server errors, request timeout, conflict."""
    return status in (408, 409, 429) or status >= 500


def http_error(status: int, *, detail: str, retry_after: float | None, cfg: LLMConfig, role: str,
               model: str) -> ApplicationError:
    """Map an HTTP error status of the endpoint to the ApplicationError Temporal should see."""
    where = f"{redact_url(cfg.base_url)} (model {model!r}, role {role})"
    delay = timedelta(seconds=retry_after) if retry_after is not None else None  # else the retry policy's
    if is_retryable_status(status):
        kind = RATE_LIMITED if status == 429 else SERVER_ERROR
        after = f"; retry after {retry_after:g}s" if retry_after is not None else ""
        return ApplicationError(f"HTTP {status} from {where}: {detail}{after}", type=kind, next_retry_delay=delay)
    model_setting = f"{setting_name('model')} or {setting_name('roles')}[{role!r}].model"
    if status in (401, 403):
        env = cfg.api_key_env or "(none)"
        message = (f"HTTP {status} from {where}: the API key was rejected: {detail}. Fix the key in the environment "
                   f"variable {env} on the agent worker, or the variable's name in {setting_name('api_key_env')}")
        kind = AUTH
    elif status == 404:
        message = (f"HTTP 404 from {where}: {detail}. Check the model name ({model_setting}) and the base URL "
                   f"({setting_name('base_url')}; OpenAI-compatible servers usually end in /v1)")
        kind = NOT_FOUND
    else:
        message = (f"HTTP {status} from {where}: the request was refused: {detail}. Check that the model "
                   f"({model_setting}) accepts this request: {setting_name('max_output_tokens')}, "
                   f"{setting_name('max_tokens_param')}, {setting_name('temperature')}, {setting_name('json_mode')}")
        kind = BAD_REQUEST
    return ApplicationError(message, type=kind, non_retryable=True)


def extract_json(text: str) -> Any:
    """The JSON object in a reply: the whole text, else a fenced block, else the outermost braces."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as first:
        fenced = re.search(r"```(?:json)?\s*\n(.*?)\n\s*```", text, flags=re.S)
        candidates = [fenced.group(1)] if fenced else []
        if "{" in text and "}" in text:
            candidates.append(text[text.index("{"): text.rindex("}") + 1])
        for candidate in candidates:
            try:
                return json.loads(candidate)
            except json.JSONDecodeError:
                continue
        raise ValueError(f"not valid JSON: {first.msg} at line {first.lineno} column {first.colno}") from None


def validation_message(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors()[:20]:
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"{loc}: {err['msg']}")
    return "schema errors: " + "; ".join(lines)


# ---------------------------------------------------------------- the call


async def heartbeating(awaitable: Awaitable[R], detail: str) -> R:
    """Await `awaitable`; inside an activity, heartbeat meanwhile (a reply can outlast the heartbeat
    timeout) so that a dead worker is still noticed and cancellation still arrives."""
    if not activity.in_activity():
        return await awaitable
    timeout = activity.info().heartbeat_timeout
    every = timeout.total_seconds() / 3 if timeout else 10.0
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            activity.heartbeat(detail)
    finally:
        if not task.done():
            task.cancel()



def _api_key(cfg: LLMConfig) -> str:
    if not cfg.api_key_env:
        return NO_KEY
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        raise ApplicationError(
            f"the environment variable {cfg.api_key_env} (named by {setting_name('api_key_env')}) is not set on this "
            f"agent worker; set it there, or set {setting_name('api_key_env')}='' for an endpoint that needs no key",
            type=CONFIG, non_retryable=True)
    return key


def _status_detail(exc: openai.APIStatusError) -> str:
    """The server's own words for an error status: OpenAI's {"error": {"message": ...}}, or the other
    shapes OpenAI-compatible servers send ({"detail": ...} from FastAPI-based ones, {"message": ...},
    {"error": "..."}), else the body itself; the client's bare "Error code: 401" only where there is none."""
    body = exc.body
    text: object = body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            text = next((err[k] for k in ("message", "detail", "msg") if err.get(k)), None) or json.dumps(err)
        else:
            text = err
    if isinstance(text, (dict, list)):
        text = json.dumps(text)
    text = str(text or exc.message or "").strip().replace("\n", " ")
    return text[:DETAIL_CHARS] or "(no detail)"


RETRYABLE_DETAIL_CHARS = 300


def _compact(call: LLMCall) -> LLMCall:
    """A record small enough for a retryable failure: the server keeps an attempt's failure for the
    next attempt's history only below a size limit (4 KB by default, stack trace included) and drops
    its details above it. The prompt is left out: the retry sends the same one, recorded there."""
    def cut(text: str | None) -> str | None:
        return text if text is None or len(text) <= RETRYABLE_DETAIL_CHARS else text[:RETRYABLE_DETAIL_CHARS] + "[...]"

    return call.model_copy(update={"messages": [], "response_text": cut(call.response_text), "error": cut(call.error)})


def _with_calls(err: ApplicationError, calls: list[LLMCall]) -> ApplicationError:
    """The same error with the audit records of the calls so far as details, for history (compact
    ones when Temporal may retry: see _compact)."""
    records = calls if err.non_retryable else [_compact(c) for c in calls]
    return ApplicationError(err.message, *[c.model_dump(mode="json") for c in records], type=err.type,
                            non_retryable=err.non_retryable, next_retry_delay=err.next_retry_delay)


async def chat_json(cfg: LLMConfig, role: str, messages: list[LLMMessage], schema: type[T],
                    check: Callable[[T], Any] | None = None) -> tuple[Any, list[LLMCall]]:
    """Ask for one JSON object matching `schema`, validate it (and `check` it), repair once.

    `check` turns the parsed reply into the role's result, raising ValueError for a reply that is
    valid JSON but unusable (e.g. an undeclared tunable); that error goes back to the model like a
    schema error. Returns the result (the parsed reply without `check`) and the audit records of
    every call made; each record keeps the parsed reply as its `output`.
    """
    model, temperature = cfg.for_role(role)
    key = _api_key(cfg)
    host = base_url_host(cfg.base_url)
    calls: list[LLMCall] = []
    # Prompts quote candidate output (failure reasons, compiler logs): nothing secret-shaped leaves.
    messages = [m.model_copy(update={"content": scrub(m.content, key)}) for m in messages]
    kwargs: dict[str, Any] = {"model": model, cfg.max_tokens_param: cfg.max_output_tokens, "stream": False}
    if temperature is not None:
        kwargs["temperature"] = temperature
    if cfg.json_mode:
        kwargs["response_format"] = {"type": "json_object"}

    async with openai.AsyncOpenAI(api_key=key, base_url=cfg.base_url, timeout=cfg.timeout_s, max_retries=0) as client:
        for attempt in (1, 2):
            record = LLMCall(role=role, model=model, temperature=temperature, base_url_host=host,
                             messages=list(messages), attempt=attempt, repair=attempt > 1,
                             activity_attempt=activity.info().attempt if activity.in_activity() else 1)
            calls.append(record)
            ckey = (reply_cache.key(cfg.cache_scope, cfg.base_url, {"messages": [m.model_dump() for m in messages],
                                                                       **kwargs})
                    if cfg.cache_scope else None)  # fmt: skip
            hit = _from_cache(ckey, record, schema, check, cfg, key) if cfg.cache_read else None
            if hit is not None:
                return hit[0], calls
            start = time.monotonic()
            try:
                resp = await heartbeating(client.chat.completions.create(
                    messages=[m.model_dump() for m in messages], **kwargs), f"{role}: waiting for {model}")
            except openai.APIStatusError as exc:
                detail = scrub(_status_detail(exc), key) or ""
                err = http_error(exc.status_code, detail=detail, retry_after=retry_after_seconds(exc.response.headers),
                                 cfg=cfg, role=role, model=model)
                raise _failed(record, start, err, calls) from None
            except openai.APITimeoutError:
                err = ApplicationError(f"no reply from {redact_url(cfg.base_url)} within {cfg.timeout_s:g}s "
                                       f"(model {model!r}, role {role}); if it repeats, raise {setting_name('timeout_s')} "
                                       f"to {2 * cfg.timeout_s:g} or more (a small model on a CPU server can take 10 "
                                       f"minutes for {cfg.max_output_tokens} tokens) or lower "
                                       f"{setting_name('max_output_tokens')}", type=TIMEOUT)
                raise _failed(record, start, err, calls) from None
            except openai.APIConnectionError as exc:
                err = ApplicationError(f"cannot reach {redact_url(cfg.base_url)} ({setting_name('base_url')}): "
                                       f"{scrub(str(exc.__cause__ or exc), key)}", type=CONNECTION)
                raise _failed(record, start, err, calls) from None
            record.latency_s = round(time.monotonic() - start, 3)
            _account(record, resp, cfg)
            _log().info("llm_call", role=role, model=model, prompt_tokens=record.usage.prompt_tokens,
                        completion_tokens=record.usage.completion_tokens, latency_s=record.latency_s)

            choice = resp.choices[0] if resp.choices else None
            text = choice.message.content if choice else None
            too_long = text is not None and len(text) > MAX_REPLY_CHARS
            if too_long:
                text = text[:MAX_REPLY_CHARS]
            record.response_text = scrub(text, key)
            record.finish_reason = choice.finish_reason if choice else None
            refusal = getattr(choice.message, "refusal", None) if choice else None
            if refusal or record.finish_reason == "content_filter":
                reason = scrub(refusal, key) or "the endpoint's content filter stopped the reply"
                record.error = f"refused: {reason}"
                raise _with_calls(ApplicationError(
                    f"the model refused (role {role}, model {model!r}): {reason}", type=REFUSED, non_retryable=True),
                    calls) from None

            try:
                if too_long:
                    raise ValueError(f"the reply was longer than {MAX_REPLY_CHARS} characters (cut there); reply with "
                                     "one JSON object of the size the schema asks for")
                reply = _parse(text, record.finish_reason, schema, cfg)
                result = check(reply) if check is not None else reply
            except (ValueError, ValidationError) as exc:
                problem = scrub(validation_message(exc) if isinstance(exc, ValidationError) else str(exc), key)
                record.error = problem
                if attempt == 1:
                    messages += [LLMMessage(role="assistant", content=record.response_text or ""),
                                 *[m for m in render("json_repair", error=problem) if m.role == "user"]]
                    continue
                raise _with_calls(ApplicationError(
                    f"the model's reply was still invalid after one repair turn (role {role}, model {model!r}): "
                    f"{problem}", type=OUTPUT_INVALID, non_retryable=True), calls) from None  # no retry fixes it:
                # the whole prompt and reply of both calls go to history (a retryable error keeps compact ones)
            record.output = json.loads(scrub(reply.model_dump_json(), key) or "null")
            if ckey is not None:
                reply_cache.put(ckey, {"text": text, "finish_reason": record.finish_reason,
                                       "response_model": record.response_model})
            return result, calls
    raise AssertionError("unreachable")


def _from_cache(ckey: str | None, record: LLMCall, schema: type[T], check, cfg: LLMConfig,
                key: str) -> tuple[Any] | None:
    """(result,) from a reply an earlier run of this lineage received for the same request, filling
    `record` (cached, nothing spent); None when there is none or it no longer passes its checks."""
    entry = reply_cache.get(ckey) if ckey else None
    if entry is None:
        return None
    try:
        reply = _parse(entry["text"], entry.get("finish_reason"), schema, cfg)
        result = check(reply) if check is not None else reply
    except (ValueError, ValidationError, KeyError, TypeError):
        return None
    record.cached = True
    record.response_text = scrub(entry["text"], key)
    record.finish_reason = entry.get("finish_reason")
    record.response_model = entry.get("response_model")
    record.output = json.loads(scrub(reply.model_dump_json(), key) or "null")
    _log().info("llm_call_cached", role=record.role, model=record.model)
    return (result,)


def _failed(record: LLMCall, start: float, err: ApplicationError, calls: list[LLMCall]) -> ApplicationError:
    record.latency_s = round(time.monotonic() - start, 3)
    record.error = f"{err.type}: {err.message}"
    _log().warning("llm_call_failed", role=record.role, model=record.model, latency_s=record.latency_s,
                   error=err.type)
    return _with_calls(err, calls)


def _account(record: LLMCall, resp: Any, cfg: LLMConfig) -> None:
    record.response_model = getattr(resp, "model", None)
    usage = getattr(resp, "usage", None)
    if usage is None:
        return
    record.usage = LLMUsage(prompt_tokens=usage.prompt_tokens or 0, completion_tokens=usage.completion_tokens or 0)
    cost = cfg.cost_usd(record.model, record.usage.prompt_tokens, record.usage.completion_tokens)
    if cost is None and record.response_model:
        cost = cfg.cost_usd(record.response_model, record.usage.prompt_tokens, record.usage.completion_tokens)
    record.cost_usd = cost


def _parse(text: str | None, finish_reason: str | None, schema: type[T], cfg: LLMConfig) -> T:
    if finish_reason == "length":
        raise ValueError(f"the reply was cut off at {cfg.max_output_tokens} tokens (if it repeats, raise "
                         f"{setting_name('max_output_tokens')} to {2 * cfg.max_output_tokens} or more); reply with a "
                         "shorter JSON object")
    if not text or not text.strip():
        raise ValueError("the reply was empty; reply with one JSON object")
    data = extract_json(text)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return schema.model_validate(data)
