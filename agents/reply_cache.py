"""Replies an earlier run of the same lineage paid for, kept on disk under KOPT_HOME.

`kopt resume RUN` starts a new workflow that repeats the old run's unfinished round; its agents ask
the same questions (same prompts, same model and parameters), and this cache gives back the answers
the old run received instead of paying for them again. The key is a hash of the scope (a token the
run's request carries: `LLMConfig.cache_scope`), the endpoint, the model and the whole request body;
only replies that parsed and passed their checks are stored. Without a scope nothing is cached.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def _root() -> Path:
    home = os.environ.get("KOPT_HOME")
    return (Path(home) if home else Path.home() / ".kopt") / "cache" / "llm"


def key(scope: str, base_url: str, body: dict[str, Any]) -> str:
    text = json.dumps([scope, base_url, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def get(k: str) -> dict[str, Any] | None:
    try:
        return json.loads((_root() / k[:2] / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None


def put(k: str, entry: dict[str, Any]) -> None:
    path = _root() / k[:2] / f"{k}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written costs money later, never correctness
