"""PyTorch reference and input generator for silu_and_mul.

Contract with the kopt harness:
  make_inputs(dims, dtype, seed, device) -> {name: tensor} for every argument of role in/inout
  reference(inputs) -> {name: tensor} for every argument of role out/inout, computed in float32
"""

import torch


def make_inputs(dims: dict[str, int], dtype: torch.dtype, seed: int, device: str) -> dict[str, torch.Tensor]:
    # Drawn on the target device: 10^8 normals take seconds on a CPU, milliseconds on a GPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    t, d = dims["T"], dims["D"]
    # Activations of a real MLP: mostly within a few units, with a heavier tail.
    x = torch.randn((t, 2 * d), generator=gen, dtype=torch.float32, device=device) * 2.0
    return {"x": x.to(dtype=dtype, device=device)}


def reference(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"].float()
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return {"out": torch.nn.functional.silu(gate) * up}
