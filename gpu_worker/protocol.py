"""What the worker and the harness child say to each other, and how the child's words are proven.

The parent sends the job and a random per-job key on the child's stdin; the child reads both
before any candidate code is loaded. Everything the child reports comes back as frames on a
private pipe, each authenticated with HMAC-SHA256 under that key and numbered, so bytes the
candidate writes to any file descriptor (a fake result, garbage, a replayed frame) are detected
as tampering instead of being believed. No torch here: the worker imports this module.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from kopt.models import DType, KernelSpec, Partial, Shape, Target, TimingMode, Tolerance

# Sampling per shape and dtype and kernel when the job sets no time_cap_s (docs/measurement.md).
TIME_CAP_S = {"cpu": 2.0, "cuda": 1.5}

HARNESS_VERSION = "12"  # bump when checks or timing change what a result means
PROGRESS_PREFIX = "kopt-harness: "  # the child also logs each step on stderr, for humans
KEY_BYTES = 32
FRAME_LIMIT = 32 << 20  # bytes of frames in all; more is garbage, not a result


class HarnessJob(BaseModel):
    """The job the parent sends and the harness child runs."""

    mode: Literal["test", "profile"]
    target: Target
    candidate_id: str
    library: str
    package_dir: str
    spec: KernelSpec
    shapes: list[Shape]
    dtypes: list[DType]
    seed: int = 0
    salt: str = ""  # per-job secret mixed into every seed: inputs the candidate cannot predict
    tolerances: dict[DType, Tolerance]
    trials: int = 2
    time_cap_s: float | None = None  # per shape and dtype; None: the target's default (TIME_CAP_S)
    baseline_library: str | None = None
    baseline_id: str | None = None
    baseline_errors: dict[str, float] = Field(default_factory=dict)
    edge_shapes: bool = True
    # Elements a fuzzed shape may hold (gpu_worker/fuzz.py); None: the target's FUZZ_BUDGET, 0: no
    # fuzzed shapes (a sanitizer's racecheck).
    fuzz_budget: int | None = None
    sequences: bool = True  # the update and burst sequences (correctness.run_sequence); off under a sanitizer
    large_shapes: bool = False  # the job's large shape (fuzz.large_shape); never under a sanitizer
    timing_mode: TimingMode = "auto"
    memory_limit_mb: int = 8192
    sandbox: bool = True  # seccomp and rlimits; off only under compute-sanitizer
    # A tool the kernel hosts run under (compute-sanitizer and its options): it watches the candidate's
    # process only, the judge's own work (references, inputs, checks) runs at full speed.
    host_prefix: list[str] = Field(default_factory=list)
    tool_paths: list[str] = Field(default_factory=list)  # the host_prefix tool's install, read-only in the jail
    noise_floor: float = 0.0
    # Pieces an earlier attempt finished (authenticated partial frames it heartbeated): skipped and
    # reported as they were.
    resume: list[Partial] = Field(default_factory=list)
    # The worker's calibrated copy bandwidth (GB/s), measured once per worker; None: measure it.
    copy_bandwidth_gbs: float | None = None
    # A job that finds the argument a memory fault went through (runner.locate_fault): only this check
    # group runs, with only `fence_only` placed against unmapped memory, the others with room around them
    # ("": every argument with room).
    only_group: str | None = None
    fence_only: str | None = None
    writable_inputs: bool = False  # locate_fault's probe: a CPU host maps inputs writable (else read-only)


# How the judge words the death of a kernel host (remote.py); the parent then adds the log's tail
# (what the kernel printed) to the reason, as it does when the harness itself dies.
HOST_DEATHS = ("crashed: ", "killed by the sandbox: ", "killed: wrote more than", "kernel process exited")


def host_death(reason: str | None) -> bool:
    return bool(reason) and reason.removeprefix("baseline: ").startswith(HOST_DEATHS)


# Address space the CPU arena keeps for "far" buffers (cases.far_bytes: 16 GiB and a little for 4-byte
# elements), one for each of the two hosts' test calls, of which only the rows are ever touched.
FAR_ARENA_BYTES = 33 << 30


def arena_bytes(memory_limit_mb: int) -> int:
    """The CPU judge's shared buffer arena (remote.Arena), sparse: half the job's memory limit, and the
    span of the far buffers."""
    return (max(memory_limit_mb, 256) << 19) + FAR_ARENA_BYTES


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def encode_stdin(key: bytes, job: HarnessJob) -> bytes:
    """What the parent writes to the child's stdin: the key in hex, a newline, the job JSON."""
    return key.hex().encode() + b"\n" + job.model_dump_json().encode()


def decode_stdin(data: bytes) -> tuple[bytearray, HarnessJob]:
    head, _, body = data.partition(b"\n")
    key = bytearray(bytes.fromhex(head.decode()))
    return key, HarnessJob.model_validate_json(body)


def frame(key: bytes | bytearray, seq: int, kind: str, body: str) -> bytes:
    """One authenticated line: `<hex mac> <json payload>\\n`; the payload carries its number."""
    payload = json.dumps({"seq": seq, "kind": kind, "body": body}, separators=(",", ":")).encode()
    mac = hmac.new(bytes(key), payload, hashlib.sha256).hexdigest().encode()
    return mac + b" " + payload + b"\n"


@dataclass
class FrameReader:
    """Parent side: verify frames as bytes arrive; remember the last step and the result."""

    key: bytes
    buffer: bytes = b""
    seq: int = 0
    size: int = 0
    last_step: str = ""
    result: str | None = None
    tampered: str | None = None  # why the channel cannot be trusted, once it cannot
    extra: list[str] = field(default_factory=list)
    partials: list[str] = field(default_factory=list)  # bodies of "partial" frames, in order
    on_partial: Callable[[str], None] | None = None

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > FRAME_LIMIT:
            self._tamper(f"more than {FRAME_LIMIT >> 20} MiB on the result channel")
            return
        self.buffer += data
        while b"\n" in self.buffer and self.tampered is None:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self._line(line)

    def close(self) -> None:
        if self.buffer.strip() and self.tampered is None:
            self._tamper(f"unterminated bytes on the result channel: {self.buffer[:60]!r}")

    def _line(self, line: bytes) -> None:
        mac, _, payload = line.partition(b" ")
        want = hmac.new(self.key, payload, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(mac, want):
            self._tamper(f"unauthenticated bytes on the result channel: {line[:60]!r}")
            return
        msg = json.loads(payload)
        if msg["seq"] != self.seq:
            self._tamper(f"frame {msg['seq']} where {self.seq} was due (replayed or dropped frame)")
            return
        self.seq += 1
        if self.result is not None:
            self._tamper("a frame after the result")
        elif msg["kind"] == "progress":
            self.last_step = msg["body"]
        elif msg["kind"] == "partial":
            self.partials.append(msg["body"])
            if self.on_partial is not None:
                self.on_partial(msg["body"])
        elif msg["kind"] == "result":
            self.result = msg["body"]
        else:
            self._tamper(f"unknown frame kind {msg['kind']!r}")

    def _tamper(self, why: str) -> None:
        if self.tampered is None:
            self.tampered = why
