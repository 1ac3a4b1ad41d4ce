"""PyTorch reference and input generator for fused_add_rmsnorm.

Contract with the kopt harness:
  make_inputs(dims, dtype, seed, device) -> {name: tensor} for every argument of role in/inout
  reference(inputs) -> {name: tensor} for every argument of role out/inout, computed in float32

Semantics (SGLang / FlashInfer fused_add_rmsnorm): s = input + residual in float32;
residual <- s rounded to the storage dtype (bit-exact); input <- s * rsqrt(mean(s^2) + EPS) * weight,
normalised from the float32 sum s, not from the rounded residual.
"""

import torch

EPS = 1e-6  # hard-coded in the kernels too (RMS_EPS)


def make_inputs(dims: dict[str, int], dtype: torch.dtype, seed: int, device: str) -> dict[str, torch.Tensor]:
    # Drawn on the target device: 10^8 normals take seconds on a CPU, milliseconds on a GPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    t, h = dims["T"], dims["H"]
    # Hidden states of a real model: per-token scales vary over orders of magnitude, so rows
    # with small and large RMS both occur; the residual stream is larger than the new input.
    row_scale = torch.exp(torch.randn((t, 1), generator=gen, device=device) * 1.5)
    x = torch.randn((t, h), generator=gen, device=device) * row_scale
    r = torch.randn((t, h), generator=gen, device=device) * row_scale * 4.0
    w = 1.0 + 0.5 * torch.randn(h, generator=gen, device=device)  # learned gains around 1, a few negative
    return {name: v.to(dtype=dtype, device=device) for name, v in (("input", x), ("residual", r), ("weight", w))}


def reference(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dtype = inputs["residual"].dtype
    s = inputs["input"].float() + inputs["residual"].float()
    out = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + EPS) * inputs["weight"].float()
    return {"input": out, "residual": s.to(dtype)}
