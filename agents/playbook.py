"""Compile options the offline planner may try, per target, with the reason each can help."""

from __future__ import annotations

PLAYBOOK: dict[str, list[tuple[str, str]]] = {
    "cpu": [
        ("-O3", "more aggressive inlining and auto-vectorisation than -O2"),
        ("-funroll-loops", "unrolled loops expose more independent work per iteration"),
        ("-ffast-math", "lets the compiler vectorise expf and reassociate; checked against tolerances"),
    ],
    "cuda": [
        ("--use_fast_math", "__expf and fast division in the sigmoid: fewer instructions per element"),
        ("--extra-device-vectorization", "lets nvcc vectorise more device loads and stores"),
        ("--ptxas-options=-dlcm=cg", "stream loads through L2 only: the data is touched once"),
    ],
}
