"""PyTorch reference and input generator for silu_and_mul.

Contract with the kopt harness:
  make_inputs(dims, dtype, seed, device, special=False) -> {name: tensor} for every argument of role
    in/inout; special=True plants zeros, signed zeros, infinities, NaN, huge and subnormal values
  reference(inputs) -> {name: tensor} for every argument of role out/inout, computed in float32
"""

import torch


def make_inputs(
    dims: dict[str, int], dtype: torch.dtype, seed: int, device: str, special: bool = False
) -> dict[str, torch.Tensor]:
    # Drawn on the target device: 10^8 normals take seconds on a CPU, milliseconds on a GPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    t, d = dims["T"], dims["D"]
    # Activations of a real MLP: mostly within a few units, with a heavier tail.
    x = torch.randn((t, 2 * d), generator=gen, dtype=torch.float32, device=device) * 2.0
    if special:  # the harness's special-values trial (docs/measurement.md, correctness 2)
        big, tiny = (3.0e4, 3.0e-6) if dtype == torch.float16 else (1.0e30, 1.0e-39)  # huge; subnormal
        # silu(-inf) is left out: 0 as a limit, NaN by the usual formulas; neither is wrong.
        plant(x[:, :d], gen, [0.0, -0.0, INF, NAN, big, -big, tiny, -tiny])
        plant(x[:, d:], gen, [0.0, INF, NAN, big, -big])
    return {"x": x.to(dtype=dtype, device=device)}


INF, NAN = float("inf"), float("nan")


def plant(x: torch.Tensor, gen: torch.Generator, values: list[float]) -> None:
    """Plant the values, one in 16 elements of x in all, at seed-chosen places that never overlap."""
    kind = torch.randint(0, 16 * len(values), x.shape, generator=gen, device=x.device)
    for i, v in enumerate(values):
        x[kind == 16 * i] = v


def reference(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"].float()
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return {"out": torch.nn.functional.silu(gate) * up}
