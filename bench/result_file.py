"""Writes a bench script's JSON record (device, versions, command and figures) into its results folder
(bench/results/ unless --out-dir says otherwise) and says where on stdout."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_record(out_dir: str | Path, name: str, record: dict) -> Path:
    """`record` as <out_dir>/<name>.json (indented, one trailing newline); the path is printed
    relative to the repository where it lies inside it."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return out
