"""Content addresses of candidates: id = hash(source, flags, toolchain)."""

from __future__ import annotations

import difflib
import hashlib
import json


def candidate_id(source: str, flags: list[str], toolchain: str) -> str:
    blob = json.dumps({"source": source, "flags": flags, "toolchain": toolchain}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def unified_diff(before: str, after: str, name: str) -> str:
    lines = difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{name}", f"b/{name}")
    return "".join(lines)
