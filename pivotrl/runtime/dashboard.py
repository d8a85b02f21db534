"""A pivotrl page in the Dask dashboard: `<dashboard>/pivotrl`.

Rendered with Bokeh from the scheduler extension's own records (so it shows exactly what the controller saw):
the role of each device over time (with a legend of the role colours, the iteration starts as dashed lines
and core's shift decisions as markers), queue depth and tokens/s per role, the learning curve (reward and
held-out accuracy per iteration, from the driver's `IterationReport`s), the planner's reasoning for each
decision (B, G, φ: `records.DecisionRecord`) and the table of role shifts with the time of each phase. The
page re-renders on every load and refreshes itself every few seconds. It is added to the scheduler's
running HTTP server (a tornado route), so it needs nothing at cluster start-up. BokehJS is inlined, so the
page renders on a cluster with no route to a CDN.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from pivotrl.runtime.metrics import PHASES, shift_phase
from pivotrl.runtime.records import DecisionRecord, PageData, learning_curve

ROLE_COLORS = {
    "rollout": "#1f77b4",
    "reward": "#ff7f0e",
    "train": "#2ca02c",
    "shifting": "#7f7f7f",
    None: "#dddddd",
}
#: The legend's name for each colour (a device with no role loaded is idle).
ROLE_LABELS = {role: ("idle" if role is None else role) for role in ROLE_COLORS}
WIDTH = 900


def _num(x: float | None) -> float:
    """None as NaN: Bokeh draws a gap and the tables show their `nan_format`."""
    return math.nan if x is None else float(x)


def _rows(n: int) -> int:
    """A table's height: its rows, up to a scrolling eight."""
    return 30 + 26 * min(max(n, 1), 8)


def _moves(d: DecisionRecord) -> str:
    return ", ".join(f"{m.device}: {m.src or 'free'}→{m.dst}" for m in d.moves) or f"{d.dissolved} freed"


def _role_figure(data: PageData, devices: list[str]) -> Any:
    from bokeh.models import ColumnDataSource, HoverTool, Label, Legend, LegendItem, Span
    from bokeh.plotting import figure

    fig = figure(
        title="role of each device (dashed: iteration starts; triangles: core's shift decisions)",
        height=150 + 40 * max(1, len(devices)),
        width=WIDTH,
        y_range=devices or ["-"],
        x_axis_label="seconds",
        tools="xpan,xwheel_zoom,reset",
    )
    # one bar per (device, sample interval), one glyph per role so the legend names each colour
    rects: dict[Any, dict[str, list[Any]]] = {r: {"x": [], "w": [], "y": [], "role": []} for r in ROLE_COLORS}
    for a, b in itertools.pairwise(data.timeline):
        for n in devices:
            role = a["roles"].get(n)
            col = rects[role if role in ROLE_COLORS else None]
            col["x"].append((a["t"] + b["t"]) / 2)
            col["w"].append(b["t"] - a["t"])
            col["y"].append(n)
            col["role"].append(ROLE_LABELS.get(role, str(role)))
    items, bars = [], []
    for role, col in rects.items():
        edge = "#aaaaaa" if role is None else ROLE_COLORS[role]  # idle's light grey needs an edge on white
        bars.append(fig.rect(x="x", y="y", width="w", height=0.8, fill_color=ROLE_COLORS[role],
                             line_color=edge, source=ColumnDataSource(col)))
        # the legend's swatch: a one-point glyph drawn nowhere (NaN), since Bokeh draws no swatch for a
        # glyph without data and a role may not have occurred yet
        swatch = fig.scatter(x=[math.nan], y=[math.nan], marker="square", size=12,
                             fill_color=ROLE_COLORS[role], line_color=edge)
        items.append(LegendItem(label=ROLE_LABELS[role], renderers=[swatch]))
    fig.add_tools(HoverTool(renderers=bars, tooltips=[("device", "@y"), ("role", "@role")]))
    for mark in data.iterations:
        fig.add_layout(Span(location=mark.t, dimension="height", line_color="black", line_dash="dashed"))
        fig.add_layout(Label(x=mark.t, y=max(1, len(devices)), text=f" it {mark.iteration}",
                             text_baseline="top", text_font_size="9pt"))  # at the top of the factor range
    marks: dict[str, list[Any]] = {k: [] for k in ("x", "y", "decision", "move", "G", "phi", "B")}
    for d in data.decisions:
        for m in d.moves:
            if m.device not in devices:
                continue
            marks["x"].append(d.t)
            marks["y"].append(m.device)
            marks["decision"].append(f"{d.decision} ({d.stimulus})")
            marks["move"].append(f"{m.src or 'free'}→{m.dst}")
            for k, v in (("G", d.gain), ("phi", d.phi), ("B", d.benefit)):
                marks[k].append("not planned" if v is None else f"{v:.3g}")
    tri = fig.scatter(x="x", y="y", source=ColumnDataSource(marks), marker="inverted_triangle", size=11,
                      color="black")
    fig.add_tools(HoverTool(renderers=[tri], tooltips=[("decision", "@decision"), ("move", "@move"),
                                                       ("G", "@G"), ("φ", "@phi"), ("B", "@B")]))
    marker = fig.scatter(x=[math.nan], y=[math.nan], marker="inverted_triangle", size=11, color="black")
    items.append(LegendItem(label="shift decision", renderers=[marker]))
    fig.add_layout(Legend(items=items, orientation="horizontal", location="top_left"), "above")
    return fig


def _series_figures(data: PageData, x_range: Any) -> list[Any]:
    from bokeh.models import Span
    from bokeh.plotting import figure

    timeline = data.timeline
    t = [s["t"] for s in timeline]
    depth_fig = figure(title="waiting sequences per role", height=220, width=WIDTH, x_range=x_range)
    rate_fig = figure(title="tokens/s per role", height=220, width=WIDTH, x_range=x_range)
    for role in ("rollout", "reward", "train"):
        depth_fig.line(t, [s["queue_depth"].get(role, 0) for s in timeline], color=ROLE_COLORS[role],
                       legend_label=role, line_width=2)
        toks = [s["tokens"].get(role, 0) for s in timeline]
        rates = [0.0][: len(t)] + [(toks[i] - toks[i - 1]) / max(t[i] - t[i - 1], 1e-9)
                                   for i in range(1, len(t))]
        rate_fig.line(t, rates, color=ROLE_COLORS[role], legend_label=role, line_width=2)
    for fig in (depth_fig, rate_fig):
        fig.legend.location = "top_left"
        for mark in data.iterations:
            fig.add_layout(Span(location=mark.t, dimension="height", line_color="black",
                                line_dash="dashed", line_alpha=0.5))
    return [depth_fig, rate_fig]


def _learning_figure(data: PageData) -> Any:
    """Reward mean (left axis) and held-out accuracy (right axis, percent) per iteration."""
    from bokeh.models import BasicTicker, ColumnDataSource, DataRange1d, HoverTool, LinearAxis, Range1d
    from bokeh.plotting import figure

    curve = learning_curve(data.reports)
    src = ColumnDataSource({
        "iteration": [r.iteration for r in curve],
        "reward": [float(r.reward_mean) for r in curve],
        "accuracy": [_num(r.heldout_accuracy) for r in curve],
        "seconds": [float(r.seconds) for r in curve],
    })
    fig = figure(title="learning curve: reward mean and held-out accuracy per iteration", height=280,
                 width=WIDTH, x_axis_label="iteration", y_axis_label="reward mean", tools="reset")
    fig.extra_y_ranges = {"acc": Range1d(0, 100)}
    fig.add_layout(LinearAxis(y_range_name="acc", axis_label="held-out accuracy (%)"), "right")
    r1 = fig.line("iteration", "reward", source=src, color="#9467bd", line_width=2,
                  legend_label="reward mean")
    dots = fig.scatter("iteration", "reward", source=src, color="#9467bd", size=6)
    fig.y_range = DataRange1d(renderers=[r1, dots])  # the reward's own scale, not the accuracy's
    fig.xaxis[0].ticker = BasicTicker(min_interval=1)  # iterations are whole numbers
    r2 = fig.line("iteration", "accuracy", source=src, color="#d62728", line_width=2, y_range_name="acc",
                  legend_label="held-out accuracy")
    fig.scatter("iteration", "accuracy", source=src, color="#d62728", size=6, y_range_name="acc")
    legend = fig.legend[0]
    legend.orientation, legend.location = "horizontal", "top_left"
    fig.add_layout(legend, "above")  # outside the plot: no point hidden under it
    fig.add_tools(HoverTool(renderers=[r1, r2], tooltips=[
        ("iteration", "@iteration"), ("reward", "@reward{0.000}"), ("accuracy %", "@accuracy{0.0}"),
        ("seconds", "@seconds{0.0}")]))
    return fig


def _decision_table(data: PageData) -> Any:
    from bokeh.models import ColumnDataSource, DataTable, NumberFormatter, TableColumn

    ds = data.decisions
    cols: dict[str, list[Any]] = {
        "t": [d.t for d in ds],
        "decision": [d.decision for d in ds],
        "stimulus": [d.stimulus for d in ds],
        "moves": [_moves(d) for d in ds],
        "role": [d.role or "" for d in ds],
        "G": [_num(d.gain) for d in ds],
        "phi": [_num(d.phi) for d in ds],
        "B": [_num(d.benefit) for d in ds],
        "threshold": [_num(d.threshold) for d in ds],
        "candidates": [d.candidates for d in ds],
    }
    fmt = NumberFormatter(format="0.000", nan_format="—", null_format="—")
    titles = {"phi": "φ", "threshold": "margin/device", "role": "for role"}
    numeric = ("G", "phi", "B", "threshold")
    widths = {"t": 55, "decision": 55, "stimulus": 170, "moves": 190, "threshold": 85, "candidates": 70}
    columns = [TableColumn(field=k, title=titles.get(k, k), width=widths.get(k, 60),
                           **({"formatter": fmt} if k in numeric else {})) for k in cols]
    return DataTable(source=ColumnDataSource(cols), columns=columns, width=WIDTH, height=_rows(len(ds)),
                     reorderable=False)


def _shift_table(data: PageData) -> Any:
    from bokeh.models import ColumnDataSource, DataTable, TableColumn

    shifts = [e for e in data.events if e.get("kind") == "shift_done" and e.get("src") is not None]
    table = {
        "t": [e["t"] for e in shifts],
        "device": [e["name"] for e in shifts],
        "src": [e["src"] for e in shifts],
        "dst": [e["role"] for e in shifts],
    }
    for ph in PHASES:
        table[ph] = [round(shift_phase(e, ph), 3) for e in shifts]
    cols = [TableColumn(field=k, title=k) for k in table]
    return DataTable(source=ColumnDataSource(table), columns=cols, width=WIDTH, height=_rows(len(shifts)),
                     reorderable=False)


def page(data: PageData) -> Any:
    """The page's Bokeh layout (tests inspect its models; `render` turns it into HTML)."""
    from bokeh.layouts import column
    from bokeh.models import Div

    devices = sorted({n for s in data.timeline for n in s["roles"]})
    roles_fig = _role_figure(data, devices)
    last = data.iterations[-1].iteration if data.iterations else None
    head = Div(text=f"<b>pivotrl</b>: {len(devices)} devices, iteration {last if last is not None else '—'}, "
                    f"{len(data.decisions)} shift decisions", width=WIDTH)
    reasoning = Div(text="<b>planner decisions</b>: G = gain of the chosen candidate, φ = its shift cost, "
                         "B = G − φ (device-seconds of work over the horizon), which must exceed "
                         "margin/device × devices moved; — where no planner weighed the decision (first "
                         "placement, static split, operator)", width=WIDTH)
    shifts = Div(text="<b>shifts</b>: seconds per phase", width=WIDTH)
    return column(head, roles_fig, *_series_figures(data, roles_fig.x_range), _learning_figure(data),
                  reasoning, _decision_table(data), shifts, _shift_table(data))


def render(data: PageData, refresh_s: int = 3) -> str:
    """The page as HTML, reloading itself every `refresh_s` seconds (never when 0)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    html = file_html(page(data), INLINE, "pivotrl")
    if refresh_s <= 0:
        return html
    return html.replace("<head>", f'<head><meta http-equiv="refresh" content="{refresh_s}">', 1)


def page_data(plugin: Any, last_samples: int = 2000) -> PageData:
    """What the page shows of a scheduler plugin: its orchestrator's records and the driver's reports."""
    orch = plugin.orch
    return PageData(timeline=orch.timeline[-last_samples:], events=orch.events, decisions=orch.decisions,
                    iterations=orch.iterations, reports=list(plugin.reports))


def _install(dask_scheduler: Any = None) -> str:
    """Runs on the scheduler: add the `/pivotrl` route to its HTTP server (idempotent)."""
    from tornado import web

    class PivotPage(web.RequestHandler):
        def get(self) -> None:
            plugin = dask_scheduler.plugins.get("pivotrl")
            if plugin is None:
                self.write("pivotrl is not running on this scheduler")
                return
            # `?refresh=0` holds the page still (reading a table, a screenshot); the default follows the run
            refresh = self.get_argument("refresh", "3")
            self.write(render(page_data(plugin), int(refresh) if refresh.isdigit() else 3))

    app = getattr(dask_scheduler, "http_application", None)
    if app is None:
        return "no http server"
    if not getattr(dask_scheduler, "_pivotrl_page", False):
        app.add_handlers(r".*", [(r"/pivotrl", PivotPage)])
        dask_scheduler._pivotrl_page = True
    return "ok"


def register_dashboard(client: Any) -> str:
    return client.run_on_scheduler(_install)
