"""Scrub secret-shaped text before it reaches a log, workflow history, a report or an LLM prompt.

Two nets: the exact values of secrets this process knows about (environment variables whose
names say KEY, TOKEN, SECRET, PASSWORD or CREDENTIAL, plus values registered with `register`,
such as the LLM API key), and shapes that look like secrets wherever they come from (API keys of
the usual providers, bearer tokens, private-key blocks, password-hash lines of /etc/shadow).
Candidate output is the main source: a sandboxed candidate cannot read the worker's secrets, but
what it prints is still treated as hostile text.
"""

from __future__ import annotations

import os
import re
import threading

MARK = "[REDACTED]"
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.I)
_MIN_LEN = 8  # shorter values would redact ordinary words
_SHAPES = [
    re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"),  # OpenAI-style keys
    re.compile(r"\b(?:gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bxox[abpr]-[A-Za-z0-9-]{10,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"),
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=\-]{12,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S),
    re.compile(r"\b[a-z_][a-z0-9_-]*:\$[0-9a-z]{1,2}\$[^:\s]*:"),  # shadow(5) entries with a hash
    re.compile(r"(?i)\b((?:api[_-]?key|secret|token|password)[\"']?\s*[:=]\s*[\"']?)[^\s\"'\\,;]{8,}"),
]
_known: set[str] = set()
_lock = threading.Lock()


def register(value: str | None) -> None:
    """Redact this exact value from now on (an API key read from a setting, say)."""
    if value and len(value) >= _MIN_LEN:
        with _lock:
            _known.add(value)


def _env_secrets() -> set[str]:
    return {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= _MIN_LEN}


def redact(text: str) -> str:
    """`text` with every known secret value and every secret-shaped string replaced by MARK."""
    if not text:
        return text
    with _lock:
        values = _known | _env_secrets()
    for value in sorted(values, key=len, reverse=True):
        if value in text:
            text = text.replace(value, MARK)
    for shape in _SHAPES:
        text = shape.sub(lambda m: (m.group(1) if m.re.groups else "") + MARK, text)
    return text


def redact_lines(lines: list[str]) -> list[str]:
    return [redact(line) for line in lines]
