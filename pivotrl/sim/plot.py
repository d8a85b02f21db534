"""Figures: device allocation over time (a row per device, a colour per role, shift decisions marked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

COLORS = {"rollout": "#1f77b4", "reward": "#ff7f0e", "train": "#2ca02c", "shift": "#9e9e9e",
          "free": "#e8e8e8"}


def allocation_json(result: Any) -> dict[str, Any]:
    """The allocation-over-time data behind the figure: per-device segments and shift events."""
    return {
        "mode": result.mode,
        "devices": result.devices,
        "makespan_s": result.makespan_s,
        "segments": [{"device": d, "t0": round(t0, 4), "t1": round(t1, 4), "role": r}
                     for d, t0, t1, r in result.segments],
        "shifts": result.shifts,
        "iterations": result.iterations,
    }


def plot_allocation(results: dict[str, Any], out: str | Path, title: str = "") -> Path:
    """One panel per paradigm; shift decisions are dotted vertical lines, iteration ends solid black."""
    out = Path(out)
    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(11, 2.2 + 1.9 * n), sharex=True, squeeze=False)
    tmax = max(r.makespan_s for r in results.values()) or 1.0
    for ax, (name, res) in zip(axes[:, 0], results.items(), strict=True):
        by_role: dict[str, dict[int, list[tuple[float, float]]]] = {}
        for d, t0, t1, role in res.segments:
            by_role.setdefault(role, {}).setdefault(d, []).append((t0, t1 - t0))
        for role, rows in by_role.items():
            for d, spans in rows.items():
                ax.broken_barh(spans, (d - 0.45, 0.9), facecolors=COLORS.get(role, "k"), linewidth=0)
        for t in sorted({s["t"] for s in res.shifts}):
            ax.axvline(t, color="k", alpha=0.25, linewidth=0.5, linestyle=":")
        for it in res.iterations:
            ax.axvline(it["start_s"] + it["total_s"], color="k", linewidth=0.8)
        ax.set_ylim(-0.5, res.devices - 0.5)
        ax.set_ylabel("device")
        tps = res.tokens_per_s_per_device
        ax.set_title(f"{name}: {tps:,.0f} tokens/s/device, {len({s['decision'] for s in res.shifts})} "
                     f"shift decisions", fontsize=9, loc="left")
        ax.set_xlim(0, tmax)
    axes[-1, 0].set_xlabel("simulated time (s)")
    handles = [Patch(color=c, label=r) for r, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
