"""Each Astra package's CUDA baseline through the test step against itself (calibrated, no sanitizer):
correct, with every variant and edge shape; prints the checks and seconds per package.

    python bench/gpu_baselines_test.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpu_worker import runner  # noqa: E402
from containment.build import build, detect_toolchain  # noqa: E402
from kopt.models import ArtifactRef, ExecRequest, PackageRef  # noqa: E402
from kopt.package import load_spec, source_path  # noqa: E402

NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")


async def main() -> int:
    tc = detect_toolchain("cuda")
    failed = 0
    for name in ("silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"):
        pkg = REPO / "kernels" / name
        spec = load_spec(pkg)
        with tempfile.TemporaryDirectory() as tmp:
            out = await build(tc, source_path(pkg, spec, "cuda").read_text(), Path(tmp), spec.build["cuda"].flags)
            assert out.ok, out.log[-2000:]
            lib = Path(tmp) / "kernel.so"
            req = ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target="cuda",
                              candidate_id=name, library=NO_ARTIFACT, shapes=spec.shapes["cuda"].test,
                              dtypes=spec.dtypes, seed=5, timeout_s=600, sanitize=False)  # fmt: skip
            t0 = time.monotonic()
            r = await runner.run_test(req, lib, pkg, spec, baseline=lib)
            checks = r.checks + r.variant_checks
            print(f"{name}: correct={r.correct} reason={r.reason} checks={len(checks)} "
                  f"skipped={sum(c.skipped for c in checks)} {time.monotonic() - t0:.1f} s")  # fmt: skip
            failed += not r.correct
    return failed


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
