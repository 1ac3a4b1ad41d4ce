"""PyTorch reference and input generator for merge_attn_states_lse.

Contract with the kopt harness:
  make_inputs(dims, dtype, seed, device) -> {name: tensor} for every argument of role in/inout
  reference(inputs) -> {name: tensor} for every argument of role out/inout, computed in float32

Semantics (SGLang merge_state, natural log), per (token t, head h), with a = s_a, b = s_b and
+inf first replaced by -inf (an empty attention state): m = max(a, b); if m == -inf (both empty)
then v_out = v_a as is and s_out = -inf; else wa = exp(a - m), wb = exp(b - m),
v_out = (v_a * wa + v_b * wb) / (wa + wb) and s_out = log(wa + wb) + m. A NaN in a or b (a NaN
from upstream) makes m NaN, so the pair's v_out and s_out are NaN, beside an empty state too
(SGLang's fmaxf-based kernel agrees: the empty side's -inf minus -inf is NaN there).
"""

import torch

# Special LSE pairs planted on every call (s_a, s_b): each on about 1/32 of the pairs where there are
# at least MIN_PAIRS of them (and a run of consecutive pairs empty on one side), else on each pair
# with one chance in two.
INF = float("inf")
SPECIAL = [(-INF, None), (None, -INF), (-INF, -INF), (INF, None), (None, INF), (INF, -INF), (INF, INF)]
MIN_PAIRS = 8


def make_inputs(dims: dict[str, int], dtype: torch.dtype, seed: int, device: str) -> dict[str, torch.Tensor]:
    # Drawn on the target device: 10^8 normals take seconds on a CPU, milliseconds on a GPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    t, nh, d = dims["T"], dims["NH"], dims["D"]
    v_a = torch.randn((t, nh, d), generator=gen, device=device)
    v_b = torch.randn((t, nh, d), generator=gen, device=device)
    # Log-sum-exp of real attention rows: a few units above zero, the two sides often far apart.
    s_a = torch.randn((t, nh), generator=gen, device=device) * 2.0 + 5.0
    s_b = torch.randn((t, nh), generator=gen, device=device) * 2.0 + 5.0
    pairs = t * nh
    if pairs >= MIN_PAIRS:
        # Each special kind on about 1/32 of the pairs (at least one), at seed-chosen places;
        # the kinds never overlap (7 * per_kind <= pairs).
        per_kind = max(1, pairs // 32)
        order = torch.randperm(pairs, generator=gen, device=device)
        flat_a, flat_b = s_a.view(-1), s_b.view(-1)
        for k, (a, b) in enumerate(SPECIAL):
            idx = order[k * per_kind : (k + 1) * per_kind]
            if a is not None:
                flat_a[idx] = a
            if b is not None:
                flat_b[idx] = b
        # A run of consecutive pairs empty on one side (cascade attention: a request with no shared
        # prefix leaves every head of its tokens empty on the prefix side), a seed-chosen side, start
        # and length (at least MIN_PAIRS + 1 pairs, up to a quarter of them).
        length = int(torch.randint(MIN_PAIRS + 1, max(MIN_PAIRS + 2, pairs // 4 + 1), (1,), generator=gen,
                                   device=device))  # fmt: skip
        length = min(length, pairs - 1)
        start = int(torch.randint(0, pairs - length + 1, (1,), generator=gen, device=device))
        side = flat_a if int(torch.randint(0, 2, (1,), generator=gen, device=device)) == 0 else flat_b
        side[start : start + length] = -INF
    elif pairs:
        # Fewer pairs (a one-token decode over a few heads per rank) meet empty states too: each pair
        # is one of the special kinds or ordinary, one chance in two, drawn by the seed.
        kinds = torch.randint(0, 2 * len(SPECIAL), (pairs,), generator=gen, device=device).tolist()
        flat_a, flat_b = s_a.view(-1), s_b.view(-1)
        for p, k in enumerate(kinds):
            if k < len(SPECIAL):
                a, b = SPECIAL[k]
                if a is not None:
                    flat_a[p] = a
                if b is not None:
                    flat_b[p] = b
    return {
        "v_a": v_a.to(dtype=dtype, device=device),
        "s_a": s_a.to(device=device),
        "v_b": v_b.to(dtype=dtype, device=device),
        "s_b": s_b.to(device=device),
    }


def reference(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    v_a, v_b = inputs["v_a"].float(), inputs["v_b"].float()
    a, b = inputs["s_a"].float(), inputs["s_b"].float()
    a = torch.where(a == INF, -INF, a)
    b = torch.where(b == INF, -INF, b)
    m = torch.maximum(a, b)
    empty = m == -INF
    m = torch.where(empty, torch.zeros_like(m), m)  # no -inf - -inf = nan below
    wa, wb = torch.exp(a - m), torch.exp(b - m)  # both 0 where empty
    total = wa + wb
    merged = (v_a * wa[..., None] + v_b * wb[..., None]) / total[..., None]  # 0/0 where empty: replaced
    v_out = torch.where(empty[..., None], v_a, merged)
    s_out = torch.where(empty, torch.full_like(m, -INF), torch.log(total) + m)
    return {"v_out": v_out, "s_out": s_out}
