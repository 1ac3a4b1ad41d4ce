"""Everything that executes kernels: device discovery, the isolated harness, checks and timing.

The worker process imports only `runner` and `device` (no torch, no CUDA context); torch lives in
the harness subprocess (`harness`, `timing`).
"""
