"""A pivotrl page in the Dask dashboard: `<dashboard>/pivotrl`.

Rendered with Bokeh from the scheduler extension's own records (so it shows exactly what the controller saw):
the role of each device over time, queue depth and tokens/s per role, and the table of role shifts with the
time of each phase. The page re-renders on every load and refreshes itself every few seconds. It is added
to the scheduler's running HTTP server (a tornado route), so it needs nothing at cluster start-up.
"""

from __future__ import annotations

import itertools
from typing import Any

from pivotrl.runtime.metrics import PHASES, shift_phase

ROLE_COLORS = {
    "rollout": "#1f77b4",
    "reward": "#ff7f0e",
    "train": "#2ca02c",
    "shifting": "#7f7f7f",
    None: "#dddddd",
}


def render(timeline: list[dict[str, Any]], events: list[dict[str, Any]], refresh_s: int = 3) -> str:
    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, DataTable, TableColumn
    from bokeh.plotting import figure
    from bokeh.resources import INLINE

    devices = sorted({n for s in timeline for n in s["roles"]})
    # 1. role of each device over time: one bar per (device, sample interval)
    rects: dict[str, list[Any]] = {"x": [], "w": [], "y": [], "color": [], "role": []}
    for a, b in itertools.pairwise(timeline):
        for n in devices:
            role = a["roles"].get(n)
            rects["x"].append((a["t"] + b["t"]) / 2)
            rects["w"].append(b["t"] - a["t"])
            rects["y"].append(n)
            rects["color"].append(ROLE_COLORS.get(role, "#dddddd"))
            rects["role"].append(str(role))
    roles_fig = figure(
        title="role of each device",
        height=60 + 40 * max(1, len(devices)),
        width=900,
        y_range=devices or ["-"],
        x_axis_label="seconds",
        tools="hover,xpan,xwheel_zoom,reset",
        tooltips=[("role", "@role")],
    )
    roles_fig.rect(x="x", y="y", width="w", height=0.8, color="color", source=ColumnDataSource(rects))
    # 2. queue depth and 3. tokens/s per role
    t = [s["t"] for s in timeline]
    depth_fig = figure(title="waiting sequences per role", height=220, width=900, x_range=roles_fig.x_range)
    rate_fig = figure(title="tokens/s per role", height=220, width=900, x_range=roles_fig.x_range)
    for role in ("rollout", "reward", "train"):
        depth_fig.line(
            t,
            [s["queue_depth"].get(role, 0) for s in timeline],
            color=ROLE_COLORS[role],
            legend_label=role,
            line_width=2,
        )
        toks = [s["tokens"].get(role, 0) for s in timeline]
        rates = [0.0] + [(toks[i] - toks[i - 1]) / max(t[i] - t[i - 1], 1e-9) for i in range(1, len(t))]
        rate_fig.line(t, rates, color=ROLE_COLORS[role], legend_label=role, line_width=2)
    # 4. shift events
    shifts = [e for e in events if e.get("kind") == "shift_done" and e.get("src") is not None]
    table = {
        "t": [e["t"] for e in shifts],
        "device": [e["name"] for e in shifts],
        "src": [e["src"] for e in shifts],
        "dst": [e["role"] for e in shifts],
    }
    for ph in PHASES:
        table[ph] = [round(shift_phase(e, ph), 3) for e in shifts]
    cols = [TableColumn(field=k, title=k) for k in table]
    shift_table = DataTable(source=ColumnDataSource(table), columns=cols, width=900, height=240)
    html = file_html(column(roles_fig, depth_fig, rate_fig, shift_table), INLINE, "pivotrl")
    return html.replace("<head>", f'<head><meta http-equiv="refresh" content="{refresh_s}">', 1)


def _install(dask_scheduler: Any = None) -> str:
    """Runs on the scheduler: add the `/pivotrl` route to its HTTP server (idempotent)."""
    from tornado import web

    class PivotPage(web.RequestHandler):
        def get(self) -> None:
            plugin = dask_scheduler.plugins.get("pivotrl")
            if plugin is None:
                self.write("pivotrl is not running on this scheduler")
                return
            self.write(render(plugin.orch.timeline[-2000:], plugin.orch.events))

    app = getattr(dask_scheduler, "http_application", None)
    if app is None:
        return "no http server"
    if not getattr(dask_scheduler, "_pivotrl_page", False):
        app.add_handlers(r".*", [(r"/pivotrl", PivotPage)])
        dask_scheduler._pivotrl_page = True
    return "ok"


def register_dashboard(client: Any) -> str:
    return client.run_on_scheduler(_install)
