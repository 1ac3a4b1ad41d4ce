"""A scripted OpenAI-compatible chat-completions server on 127.0.0.1, for tests without network.

It speaks just enough of the protocol for the real `openai` client: POST /v1/chat/completions
(`"stream": false` only) answered with a ChatCompletion body including usage. Each request takes
the next entry of the script:

    Reply.json({...})             a JSON object as the message content (delay_s=2.5: answer late)
    Reply.json({...}, prompt_tokens=None, completion_tokens=None)
                                  usage estimated from the text (ESTIMATE_CHARS_PER_TOKEN)
    Reply.raw("not json")         any content string (malformed JSON, fenced JSON, ...)
    Reply.refused("I can't")      message.refusal set, content null
    Reply.filtered()              finish_reason "content_filter"
    Status(429, {"Retry-After": "7"})   an HTTP error with headers and an OpenAI-style error body
    Delay(5.0)                    answer nothing for 5 s (longer than the client's timeout)

Every request is recorded (path, headers, JSON body) so tests can assert on the prompts.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


ESTIMATE_CHARS_PER_TOKEN = 4  # rough for English and code with GPT tokenizers; no tokenizer offline


def estimate_tokens(text: str) -> int:
    return -(-len(text) // ESTIMATE_CHARS_PER_TOKEN)


@dataclass
class Reply:
    content: str | None
    finish_reason: str = "stop"
    refusal: str | None = None
    prompt_tokens: int | None = 100  # None: estimated from the request's message contents
    completion_tokens: int | None = 50  # None: estimated from the content
    model: str | None = None  # default: the model asked for
    delay_s: float = 0.0  # answer after this long

    @classmethod
    def json(cls, obj: Any, **kw: Any) -> Reply:
        return cls(content=json.dumps(obj), **kw)

    @classmethod
    def raw(cls, text: str, **kw: Any) -> Reply:
        return cls(content=text, **kw)

    @classmethod
    def refused(cls, why: str = "I can't help with that.", **kw: Any) -> Reply:
        return cls(content=None, refusal=why, **kw)

    @classmethod
    def filtered(cls, **kw: Any) -> Reply:
        return cls(content=None, finish_reason="content_filter", **kw)


@dataclass
class Status:
    code: int
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "scripted error"
    body: dict[str, Any] | None = None  # sent instead of OpenAI's error shape (other servers' bodies)


@dataclass
class Delay:
    seconds: float


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.body.get("messages", [])

    @property
    def text(self) -> str:
        """All message contents of the request, joined."""
        return "\n".join(m.get("content") or "" for m in self.messages)


class FakeOpenAI:
    """Context manager: `with FakeOpenAI([...]) as srv:` then point a client at `srv.base_url`."""

    def __init__(self, script: list[Reply | Status | Delay] | None = None) -> None:
        self.script: list[Reply | Status | Delay] = list(script or [])
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def push(self, *entries: Reply | Status | Delay) -> None:
        with self._lock:
            self.script.extend(entries)

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # wakes any Delay still sleeping
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _next(self) -> Reply | Status | Delay | None:
        with self._lock:
            return self.script.pop(0) if self.script else None

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            def _send(self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    body = {"_unparsed": raw.decode(errors="replace")}
                fake.requests.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, _error(f"no route {self.path}", "not_found"))
                    return
                if body.get("stream"):
                    self._send(400, _error("this fake server supports stream=false only", "invalid_request_error"))
                    return
                entry = fake._next()
                if entry is None:
                    self._send(500, _error("fake server: script exhausted", "server_error"))
                elif isinstance(entry, Delay):
                    fake._stop.wait(entry.seconds)
                    self._send(500, _error("fake server: delayed reply", "server_error"))
                elif isinstance(entry, Status):
                    self._send(entry.code, entry.body if entry.body is not None else _error(entry.message, "scripted"),
                               entry.headers)
                else:
                    if entry.delay_s:
                        fake._stop.wait(entry.delay_s)
                    self._send(200, _completion(entry, body))

            def do_GET(self) -> None:
                self._send(404, _error(f"no route {self.path}", "not_found"))

        return Handler


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _completion(reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
    model = body.get("model", "unknown")
    prompt_tokens = reply.prompt_tokens
    if prompt_tokens is None:
        prompt_tokens = estimate_tokens("".join(m.get("content") or "" for m in body.get("messages", [])))
    completion_tokens = reply.completion_tokens
    if completion_tokens is None:
        completion_tokens = estimate_tokens(reply.content or reply.refusal or "")
    return {
        "id": f"chatcmpl-fake-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": reply.model or model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": reply.content, "refusal": reply.refusal},
            "finish_reason": reply.finish_reason,
            "logprobs": None,
        }],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
