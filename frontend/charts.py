"""Charts of a run for people: per-shape speedup of the best (with its A/B interval), %SOL of the
baseline and the best, and the rounds' progress. PNG bytes (matplotlib, no display); report.md links
the files, the HTML export embeds them."""

from __future__ import annotations

import io

from kopt.models import RoundRecord, ShapeSpeedup

WIDTH_IN = 7.5


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display, the same pixels everywhere
    import matplotlib.pyplot as plt

    return plt


def warm() -> None:
    """Import matplotlib ahead (about 0.6 s on a 2-core VM): `kopt optimize` does it beside the run, so
    the report after the last round, inside the wall-time budget's reserve, does not wait for it."""
    try:
        _pyplot()
    except ImportError:
        pass


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def speedup_chart(per_shape: list[ShapeSpeedup], title: str) -> bytes:
    """Speedup over the baseline per (shape, dtype), the 95 % interval as error bars; red below 1."""
    plt = _pyplot()
    labels = [f"{s.shape} {s.dtype}" for s in per_shape]
    values = [s.speedup for s in per_shape]
    lo = [max(0.0, s.speedup - s.ci_low) if s.ci_low is not None else 0.0 for s in per_shape]
    hi = [max(0.0, s.ci_high - s.speedup) if s.ci_high is not None else 0.0 for s in per_shape]
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.45 * len(labels) + 1.2))
    colors = ["#c0392b" if (s.ci_high is not None and s.ci_high < 1) or s.speedup < 1 else "#2e86c1"
              for s in per_shape]  # fmt: skip
    ax.barh(range(len(labels)), values, xerr=[lo, hi], color=colors, capsize=3)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the baseline (baseline time / best time), 95 % interval")
    ax.set_title(title)
    return _png(fig)


def sol_chart(baseline: dict[str, float], best: dict[str, float], title: str) -> bytes:
    """% of the device's copy bandwidth reached (speed of light), baseline beside best, per shape."""
    plt = _pyplot()
    labels = list(best) or list(baseline)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.5 * len(labels) + 1.2))
    ys = range(len(labels))
    ax.barh([y - 0.2 for y in ys], [baseline.get(k, 0.0) for k in labels], height=0.4, label="baseline",
            color="#95a5a6")  # fmt: skip
    ax.barh([y + 0.2 for y in ys], [best.get(k, 0.0) for k in labels], height=0.4, label="best", color="#27ae60")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel("% of the copy bandwidth (SOL)")
    ax.legend(loc="best")
    ax.set_title(title)
    return _png(fig)


def progress_chart(rounds: list[RoundRecord], title: str) -> bytes:
    """Each candidate's geomean speedup by round (x, at the bottom: wrong or not built), and the best
    so far."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.2))
    best, xs, ys = 1.0, [0], [1.0]
    measured = [r.speedup_geomean for r in rounds if r.speedup_geomean is not None]
    floor = min([1.0, *measured]) * 0.97  # where candidates without a speedup (wrong, not built) are marked
    for r in sorted(rounds, key=lambda r: (r.round, r.slot)):
        if r.speedup_geomean is None:
            ax.scatter([r.round], [floor], marker="x", color="#c0392b")
            continue
        ax.scatter([r.round], [r.speedup_geomean], color="#27ae60" if r.accepted else "#7f8c8d",
                   zorder=3)  # fmt: skip
        if r.accepted:
            best = r.speedup_geomean
        xs.append(r.round)
        ys.append(best)
    ax.step(xs, ys, where="post", color="#2e86c1", label="best so far")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("round")
    ax.set_ylabel("geomean speedup")
    ax.legend(loc="upper left")
    ax.set_title(title)
    return _png(fig)


def run_charts(kernel: str, target: str, baseline_sol: dict[str, float], best_per_shape: list[ShapeSpeedup],
               rounds: list[RoundRecord]) -> dict[str, bytes]:  # fmt: skip
    """The charts of one run by file name (only those it has data for; none where matplotlib is not
    installed, e.g. a GPU machine given only kopt's runtime wheels: the report says so)."""
    try:
        _pyplot()
    except ImportError:
        return {}
    charts: dict[str, bytes] = {}
    if best_per_shape:
        charts["speedup.png"] = speedup_chart(best_per_shape, f"{kernel} ({target}): the best, per shape")
        best_sol = {f"{s.shape} {s.dtype}": s.pct_sol for s in best_per_shape if s.pct_sol is not None}
        if best_sol:
            charts["sol.png"] = sol_chart(baseline_sol, best_sol, f"{kernel} ({target}): % of speed of light")
    if rounds:
        charts["progress.png"] = progress_chart(rounds, f"{kernel} ({target}): rounds")
    return charts
