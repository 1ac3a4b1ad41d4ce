"""Process-group helpers shared by the compiler runs (containment.build) and the harness children
(gpu_worker.spawn): both start their child in a new session so the whole group can be killed."""

from __future__ import annotations

import os
import signal


def kill_group(pid: int) -> bool:
    """SIGKILL the process group led by `pid`; True when some process was still in it."""
    try:
        os.killpg(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
