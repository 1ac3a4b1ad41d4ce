"""ReverifyBest: a run's best judged again, against the baseline, on every GPU class asked for.

Started by a schedule (`kopt schedule create`): a new driver, toolkit or firmware can make a best
wrong or slower than the baseline it beat. Both sources are compiled once on their build queue,
then tested and profiled A/B on the exec queue of each class in parallel, with the same activities
and options as OptimizeKernel (kopt/activity_table.py). Deterministic and free of I/O.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kopt import queues
    from kopt.activity_table import COMPILE, PROFILE, TEST, ActivityDef
    from kopt.models import (
        Candidate,
        CompileRequest,
        CompileResult,
        ExecRequest,
        slower_beyond,
    )
    from kopt.run_models import ClassVerdict, ReverifyRequest, ReverifyResult
    from workflows import judging

from workflows.patches import NOISE_FLOOR_PATCH  # the same rule and patch as OptimizeKernel's shape guard


@workflow.defn(name=queues.REVERIFY_WORKFLOW_NAME)
class ReverifyBest:
    @workflow.run
    async def run(self, req: ReverifyRequest) -> ReverifyResult:
        base, best = await asyncio.gather(self._compile(req, req.baseline), self._compile(req, req.best))
        classes = req.gpu_classes if req.target == "cuda" else [None]
        if not base.ok or base.library is None:
            why = f"the baseline does not compile: {judging.compile_error(base.log_tail)}"
            verdicts = [ClassVerdict(gpu_class=c, correct=False, reason=why) for c in classes]
        elif not best.ok or best.library is None:
            why = f"the best does not compile: {judging.compile_error(best.log_tail)}"
            verdicts = [ClassVerdict(gpu_class=c, correct=False, reason=why) for c in classes]
        else:
            floored = workflow.patched(NOISE_FLOOR_PATCH)
            verdicts = list(await asyncio.gather(*[self._judge(req, c, base, best, floored) for c in classes]))
        return ReverifyResult(run=req.run, candidate_id=req.best.id, verdicts=verdicts,
                              ok=all(v.ok for v in verdicts))  # fmt: skip

    def _options(self, defn: ActivityDef, req: ReverifyRequest, gpu_class: str | None) -> dict:
        return defn.options(req.target, req.toolchain, gpu_class, req.timeouts)

    async def _compile(self, req: ReverifyRequest, cand: Candidate) -> CompileResult:
        arg = CompileRequest(package=req.package, target=req.target, toolchain=req.toolchain, candidate=cand)
        return await COMPILE.execute(arg, **self._options(COMPILE, req, None))

    async def _judge(self, req: ReverifyRequest, gpu_class: str | None, base: CompileResult,
                     best: CompileResult, floored: bool) -> ClassVerdict:  # fmt: skip
        shapes = req.package.spec.shapes[req.target]

        def request(shape_list) -> ExecRequest:
            return ExecRequest(package=req.package, target=req.target, candidate_id=req.best.id, library=best.library,
                               shapes=shape_list, dtypes=req.package.spec.dtypes, seed=req.seed,
                               source=req.best.source, baseline_library=base.library,
                               baseline_id=req.baseline.id)  # fmt: skip

        judged = await judging.judge(
            best, lambda: TEST.execute(request(shapes.test), **self._options(TEST, req, gpu_class)),
            lambda: PROFILE.execute(request(shapes.bench), **self._options(PROFILE, req, gpu_class)))  # fmt: skip
        profiled = judged.profiled
        if profiled is None or not profiled.ok or profiled.ab is None:
            why = judged.failure() or "profile failed: no A/B against the baseline"
            return ClassVerdict(gpu_class=gpu_class, correct=False, reason=why)
        floor = profiled.ab.noise_floor if floored else 0.0
        slow = [f"{a.shape} {a.dtype}" for a in profiled.ab.per_shape if slower_beyond(a.ci_high, noise_floor=floor)]
        return ClassVerdict(gpu_class=gpu_class, correct=True, speedup_geomean=profiled.ab.speedup_geomean,
                            speedup_ci=[profiled.ab.ci_low, profiled.ab.ci_high], regressions=slow)  # fmt: skip
