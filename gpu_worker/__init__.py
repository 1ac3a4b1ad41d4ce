"""Everything that executes kernels: device discovery, the isolated harness, checks and timing.

The worker process imports only the parent side (`runner`, `spawn`, `protocol`, `static_checks`,
`sanitizer`, `device`: no torch, no CUDA context). The harness child (`harness`, forked by
`zygote`), the judge, runs the rest: `sandbox` (rlimits, seccomp), `context`, `abi` and `remote`
(the kernel hosts it starts, each `kernel_host` loading one library; `cuda_driver` on CUDA),
`plan`/`cases`/`checks`/`correctness` (test mode), `timing`/`nvml`/`stats`/`profiling` (profile mode).
See docs/decisions/0007-measurement.md.
"""
