"""Errors the CLI turns into a one-line message and an exit code."""


class UsageError(Exception):
    """Bad input from the user (exit 2)."""


class RunFailed(Exception):
    """The run could not produce a result, e.g. the baseline does not compile (exit 1)."""


def failure_chain(exc: BaseException) -> str:
    """A Temporal failure in one line, outermost first: "activity plan (attempt 5): HTTP 500 from ..."
    instead of the SDK's "Workflow execution failed"."""
    parts, seen = [], 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        seen += 1
        name = type(cur).__name__
        if name == "WorkflowFailureError":
            pass
        elif name == "ActivityError":
            parts.append(f"activity {getattr(cur, 'activity_type', '?')}")
        elif name == "TimeoutError" and hasattr(cur, "type"):
            parts.append(f"timed out ({getattr(cur.type, 'name', cur.type)})")
        elif name == "ApplicationError" or not parts:
            message = getattr(cur, "message", None) or str(cur)
            parts.append(message.strip().splitlines()[0] if message.strip() else name)
        cur = getattr(cur, "cause", None) or cur.__cause__
    return ": ".join(parts) or str(exc)
