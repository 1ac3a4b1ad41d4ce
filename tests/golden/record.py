"""Record a golden OptimizeKernel history for the replay test (tests/test_replay_golden.py).

Run when the workflow changes *intentionally* in a way running workflows can absorb (use
workflow.patched() for that), never to paper over a non-deterministic change:
    python tests/golden/record.py                  # history-1.json, history-2.json
    python tests/golden/record.py --candidates 2   # history-slots2-*.json: asynchronous slots
It runs a short offline optimization of the `repeat` fixture on a fresh dev server, with two
history segments (continue-as-new), and writes each segment's history as JSON (replacing only the
files of its own name).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from frontend.history import segments  # noqa: E402
from frontend.runs import prepare_request  # noqa: E402
from frontend.server import start_dev_server  # noqa: E402
from kopt import queues  # noqa: E402
from kopt.run_models import OptimizeResult  # noqa: E402
from kopt.settings import Settings  # noqa: E402
from tests.conftest import cpu_cluster  # noqa: E402

OUT = Path(__file__).resolve().parent


async def main(candidates: int) -> None:
    prefix = "history" if candidates == 1 else f"history-slots{candidates}"
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        server = start_dev_server(home / "temporal.db", port=0, ui_port=0, headless=True)
        try:
            settings = Settings(home=home)
            rounds, every = (3, 2) if candidates == 1 else (2, 1)  # several candidates: a round a segment
            req = prepare_request(REPO / "tests" / "fixtures" / "repeat", "cpu", None, rounds, "offline", 1, settings)
            req = req.model_copy(update={"continue_every": every, "candidates_per_round": candidates})
            async with cpu_cluster(server.address, settings) as client:
                wf_id = "golden-repeat"
                await client.execute_workflow(queues.WORKFLOW_NAME, req, id=wf_id, task_queue=queues.WORKFLOW_QUEUE,
                                              result_type=OptimizeResult)
                for old in OUT.glob(f"{prefix}-[0-9]*.json"):
                    old.unlink()
                for i, history in enumerate(await segments(client, wf_id), start=1):
                    (OUT / f"{prefix}-{i}.json").write_text(history.to_json())
                    print(f"wrote {prefix}-{i}.json ({len(history.events)} events)")
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[sys.argv.index("--candidates") + 1]) if "--candidates" in sys.argv else 1))
