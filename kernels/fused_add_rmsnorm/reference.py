"""PyTorch reference and input generator for fused_add_rmsnorm.

Contract with the kopt harness:
  make_inputs(dims, dtype, seed, device, special=False) -> {name: tensor} for every argument of role
    in/inout; special=True plants zero, cancelling, huge, tiny and NaN rows and zero weights
  reference(inputs) -> {name: tensor} for every argument of role out/inout, computed in float32

Semantics (SGLang / FlashInfer fused_add_rmsnorm): s = input + residual in float32;
residual <- s rounded to the storage dtype (bit-exact); input <- s * rsqrt(mean(s^2) + EPS) * weight,
normalised from the float32 sum s, not from the rounded residual.
"""

import torch

EPS = 1e-6  # hard-coded in the kernels too (RMS_EPS)


def make_inputs(
    dims: dict[str, int], dtype: torch.dtype, seed: int, device: str, special: bool = False
) -> dict[str, torch.Tensor]:
    # Drawn on the target device: 10^8 normals take seconds on a CPU, milliseconds on a GPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    t, h = dims["T"], dims["H"]
    # Hidden states of a real model: per-token scales vary over orders of magnitude, so rows
    # with small and large RMS both occur; the residual stream is larger than the new input.
    row_scale = torch.exp(torch.randn((t, 1), generator=gen, device=device) * 1.5)
    x = torch.randn((t, h), generator=gen, device=device) * row_scale
    r = torch.randn((t, h), generator=gen, device=device) * row_scale * 4.0
    w = 1.0 + 0.5 * torch.randn(h, generator=gen, device=device)  # learned gains around 1, a few negative
    if special:  # the harness's special-values trial (docs/measurement.md, correctness 2)
        plant_rows(x, r, w, gen, dtype)
    return {name: v.to(dtype=dtype, device=device) for name, v in (("input", x), ("residual", r), ("weight", w))}


def plant_rows(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, gen: torch.Generator, dtype: torch.dtype) -> None:
    """Special rows, each kind on about 1/8 of the rows (at least one when there are rows enough), at
    seed-chosen places: all zeros; input = -residual (the sum cancels exactly); huge values (the sum
    of squares near the top of float32's range for 32-bit-range dtypes); tiny values (the squares
    underflow: the norm is EPS's); a NaN (the whole row is NaN). And a few zero weights."""
    big = 3.0e4 if dtype == torch.float16 else 1.0e15
    t = x.shape[0]
    kinds = torch.randperm(t, generator=gen, device=x.device)
    per = max(1, t // 8) if t >= 5 else 0
    rows = [kinds[k * per : (k + 1) * per] for k in range(5)]
    x[rows[0]], r[rows[0]] = 0.0, 0.0
    r[rows[1]] = (-x[rows[1]]).to(dtype).float()  # exactly representable: the sum is exactly zero
    x[rows[1]] = x[rows[1]].to(dtype).float()
    x[rows[2]], r[rows[2]] = x[rows[2]].sign() * big, r[rows[2]].sign() * big
    x[rows[3]], r[rows[3]] = x[rows[3]] * 1e-30, r[rows[3]] * 1e-30
    x[rows[4], 0] = float("nan")
    w[torch.randint(0, w.shape[0], (max(1, w.shape[0] // 64),), generator=gen, device=w.device)] = 0.0


def reference(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dtype = inputs["residual"].dtype
    s = inputs["input"].float() + inputs["residual"].float()
    out = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + EPS) * inputs["weight"].float()
    return {"input": out, "residual": s.to(dtype)}
