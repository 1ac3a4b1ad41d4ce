"""The planner's view of a run's history, bounded: the latest records in full, older ones compacted.

Every plan request used to carry every record of the run, so each round added more to workflow
history than the one before. `compact_history` keeps the last `PLAN_WINDOW` records whole and
folds the older ones into a HistoryDigest: one short entry per distinct configuration tried (its
key and latest outcome), the most frequent failure reasons with counts and the fastest few results.
Pure and deterministic: the workflow calls it (docs/decisions/0008-compact-plan-history.md).
"""

from __future__ import annotations

from kopt.agent_models import EVALUATING
from kopt.models import HistoryDigest, RoundRecord

PLAN_WINDOW = 20  # records a plan request carries in full
FAILURE_REASONS = 10  # distinct failure reasons kept in a digest; the rest are counted as "other"
REASON_CHARS = 120  # a failure reason is cut to this length before counting
TOP = 5  # fastest older results listed in a digest


def config_key(tunables: dict[str, int], flags: list[str]) -> str:
    """A configuration (tunable values and compile flags) as one short canonical string:
    "BLOCK=256,VEC=4|-O3 -march=native". Order-insensitive in both parts."""
    values = ",".join(f"{name}={value}" for name, value in sorted(tunables.items()))
    return f"{values}|{' '.join(sorted(flags))}"


def outcome(record: RoundRecord) -> str:
    """A record's result in a few words: "1.013x", "1.013x best", "compile error", "evaluating"."""
    if record.speedup_geomean is not None:
        return f"{record.speedup_geomean:.3f}x" + (" best" if record.accepted else "")
    kind = record.kind
    if kind in ("evaluating", "compile error", "wrong result", "profile failed", "cancelled"):
        return kind
    if record.failure:  # no candidate: the agent's reply was unusable
        return record.failure.split(":", 1)[0]
    return "compiled" if record.compiled else "did not compile"


def digest(records: list[RoundRecord]) -> HistoryDigest:
    """Fold records (oldest first) into a digest; its size grows with distinct configurations only."""
    tried: dict[str, str] = {}
    reasons: dict[str, int] = {}
    for r in records:
        key = config_key(r.tunables, r.flags)
        tried.pop(key, None)  # a configuration tried again moves to the end with its latest outcome
        tried[key] = outcome(r)
        if r.failure and r.failure != EVALUATING:
            reason = r.failure[:REASON_CHARS]
            reasons[reason] = reasons.get(reason, 0) + 1
    ranked = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    failures = dict(ranked[:FAILURE_REASONS])
    other = sum(count for _, count in ranked[FAILURE_REASONS:])
    if other:
        failures["other"] = other
    fastest = sorted((r for r in records if r.speedup_geomean is not None),
                     key=lambda r: (-r.speedup_geomean, r.round, r.slot))[:TOP]
    top = [f"round {r.round}: {r.description} | {config_key(r.tunables, r.flags)} | {outcome(r)}" for r in fastest]
    return HistoryDigest(records=len(records), last_round=records[-1].round if records else 0, tried=tried,
                         failures=failures, top=top)


def compact_history(records: list[RoundRecord], window: int = PLAN_WINDOW
                    ) -> tuple[list[RoundRecord], HistoryDigest | None]:
    """(the last `window` records, a digest of the older ones or None when there are none)."""
    if len(records) <= window:
        return list(records), None
    cut = len(records) - max(window, 0)
    return list(records[cut:]), digest(records[:cut])
