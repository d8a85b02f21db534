"""The `/pivotrl` page's data sources, without a browser: core's decisions become typed records with the
planner's B, G, φ; iteration starts are marked; the driver's reports make the learning curve; and the
page's Bokeh models carry each of them (the legend of role colours, the iteration lines, the curve, the
decision table). The page in a real browser is tests/runtime/test_dashboard_browser.py."""

from __future__ import annotations

import math

import pytest

from pivotrl.core import Controller, ControllerConfig, IterationPlan, Role, RoleSpec
from pivotrl.core.decision import Candidate, Decision, DeviceMove, PlanReasoning, ReplicaShift
from pivotrl.runtime.dashboard import ROLE_LABELS, page, page_data, render
from pivotrl.runtime.messages import IterationReport
from pivotrl.runtime.records import DecisionRecord, IterationMark, MoveRecord, PageData, learning_curve
from pivotrl.runtime.scheduler_plugin import PivotSchedulerPlugin
from tests.runtime.inproc import InProcessRuntime
from tests.runtime.test_mechanism import gen_items, manual, specs
from tests.runtime.test_role_host import wait


def planned_decision() -> Decision:
    cand = Candidate(devices=1, donors=("rep-1",), donors_per_role={"rollout": 1}, new_replicas=1, gain=3.5,
                     penalty=1.25)
    other = Candidate(devices=2, donors=("rep-1", "rep-2"), donors_per_role={"rollout": 2}, new_replicas=2,
                      gain=4.0, penalty=3.0)
    reasoning = PlanReasoning(now=7.0, tau={"reward": 2.0}, throughput={}, work_tokens={},
                              shift_up_role="reward", candidates=(cand, other), chosen=cand, threshold=0.5)
    move = DeviceMove("tcp://a:1", Role.ROLLOUT, Role.REWARD, "rep-1")
    return Decision(12, 7.0, "planner:tau[reward]=2", "shift", dissolved=["rep-1"],
                    shifts=[ReplicaShift("rep-9", Role.REWARD, ("tcp://a:1",), (move,))], reasoning=reasoning)


def test_a_decision_record_carries_the_chosen_candidates_b_g_phi() -> None:
    rec = DecisionRecord.of(planned_decision(), {"tcp://a:1": "0"}.get)
    assert rec.moves == (MoveRecord("0", "rollout", "reward"),)  # names, as the timeline shows devices
    assert (rec.gain, rec.phi, rec.benefit) == (3.5, 1.25, 2.25)  # the chosen one, not the best-G one
    assert rec.threshold == 0.5 and rec.candidates == 2 and rec.role == "reward" and rec.dissolved == 1
    assert (rec.t, rec.decision, rec.stimulus) == (7.0, 12, "planner:tau[reward]=2")
    assert DecisionRecord.from_wire(rec.to_wire()) == rec
    unplanned = DecisionRecord.of(Decision(3, 1.0, "manual:initial", "shift", shifts=[ReplicaShift(
        "rep-1", Role.ROLLOUT, ("d",), (DeviceMove("d", None, Role.ROLLOUT, None),))]))
    assert unplanned.moves == (MoveRecord("d", None, "rollout"),)
    assert unplanned.gain is unplanned.phi is unplanned.benefit is unplanned.threshold is None


def test_the_orchestrator_records_core_planner_decisions_and_iteration_starts() -> None:
    """core's shiftable planner on two in-process role hosts: rollout work, then only reward work, so it
    moves a device to reward. Every record agrees with core's own decision log, and each planned one
    cleared the planner's margin."""
    roles = {r: RoleSpec(max_seqs=8, kv_tokens=1 << 20, prior_step_a_s=0.01, prior_step_b_s=0.0)
             for r in Role}
    ctl = Controller("shiftable", config=ControllerConfig(roles=roles, horizon_s=5.0, cooldown_s=0.3,
                                                          shift_prior_s=0.05))
    rt = InProcessRuntime(ctl, specs(step_s=0.005), n_workers=2)
    try:
        t0 = rt.now()
        rt.call("begin_iteration", IterationPlan(0, 24), t0)
        rt.submit(gen_items("r", 24, 30))
        wait(rt, {f"r{i}" for i in range(24)}, timeout_s=60)
        rt.call("begin_iteration", IterationPlan(1, 0), rt.now())
        rt.submit(gen_items("j", 24, 60, role="reward"))
        wait(rt, {f"j{i}" for i in range(24)}, timeout_s=60)
        with rt.lock:
            marks, records, log = list(rt.orch.iterations), list(rt.orch.decisions), list(ctl.log)
            names = {a: w.name for a, w in rt.orch.workers.items()}
    finally:
        rt.close()
    assert [m.iteration for m in marks] == [0, 1] and marks[0].t == round(t0, 4) <= marks[1].t
    by_id = {e["decision_id"]: e for e in log}
    assert records and all(r.moves for r in records)
    for r in records:
        core = by_id[r.decision]
        assert r.t == pytest.approx(core["now"], abs=1e-4) and r.stimulus == core["stimulus"]
        assert [(m.device, m.src, m.dst) for m in r.moves] == [
            (names[d], src, s["to_role"]) for s in core["shifts"] for d, src, _ in s["from"]]
        chosen = (core["reasoning"] or {}).get("chosen")
        if chosen is None:
            assert r.benefit is None
            continue
        assert (r.gain, r.phi, r.benefit) == (chosen["G"], chosen["phi"], chosen["B"])
        assert r.benefit == pytest.approx(r.gain - r.phi)
        assert r.benefit > r.threshold * chosen["devices"]  # the planner only shifts past its margin
    to_reward = [r for r in records if any(m.src == "rollout" and m.dst == "reward" for m in r.moves)]
    assert to_reward and to_reward[-1].benefit is not None and to_reward[-1].role == "reward"
    assert {m.device for r in records for m in r.moves} <= {"0", "1"}  # worker names, not addresses


def test_the_plugin_keeps_the_drivers_reports_for_the_learning_curve() -> None:
    plugin = PivotSchedulerPlugin(manual(["rollout"]), specs())
    for rep in (IterationReport(0, 2.0, 0.1, 1), IterationReport(1, 2.0, 0.3, 2, heldout_accuracy=40.0),
                IterationReport(1, 2.5, 0.35, 2, heldout_accuracy=45.0)):  # a resumed run repeats 1
        plugin.handle_report(rep.to_wire())
    curve = learning_curve(page_data(plugin).reports)
    assert [(r.iteration, r.reward_mean, r.heldout_accuracy) for r in curve] == [(0, 0.1, None),
                                                                                 (1, 0.35, 45.0)]


def sample_page() -> PageData:
    timeline = [{"t": t, "roles": {"0": "rollout" if t < 2 else "shifting", "1": None},
                 "queue_depth": {"rollout": 4}, "tokens": {"rollout": 10 * t}} for t in (0.0, 1.0, 2.0, 3.0)]
    decisions = [DecisionRecord.of(planned_decision(), {"tcp://a:1": "0"}.get),
                 DecisionRecord(0.5, 1, "initial", (MoveRecord("1", None, "reward"),))]
    return PageData(timeline=timeline, decisions=decisions,
                    iterations=[IterationMark(0, 0.25), IterationMark(1, 2.5)],
                    reports=[IterationReport(0, 1.0, 0.2, 1),
                             IterationReport(1, 1.0, 0.5, 2, heldout_accuracy=30.0)])


def test_the_page_has_a_role_legend_iteration_lines_the_learning_curve_and_the_reasoning() -> None:
    from bokeh.models import ColumnDataSource, DataTable, Label, LegendItem, Span

    layout = page(sample_page())
    labels = {str(item.label.value) for item in layout.select({"type": LegendItem})}
    assert {*ROLE_LABELS.values(), "shift decision"} <= labels  # every role colour is named, idle included
    spans = [s.location for s in layout.select({"type": Span})]
    assert spans.count(0.25) == 3 and spans.count(2.5) == 3  # one line per time chart per iteration
    assert {lb.text.strip() for lb in layout.select({"type": Label})} == {"it 0", "it 1"}
    sources = list(layout.select({"type": ColumnDataSource}))
    curve = next(s.data for s in sources if "accuracy" in s.data)
    assert curve["iteration"] == [0, 1] and curve["reward"] == [0.2, 0.5]
    assert math.isnan(curve["accuracy"][0]) and curve["accuracy"][1] == 30.0  # not evaluated: a gap
    table = next(t for t in layout.select({"type": DataTable}) if "B" in t.source.data)
    assert table.source.data["B"][0] == 2.25 and math.isnan(table.source.data["B"][1])
    assert table.source.data["moves"] == ["0: rollout→reward", "1: free→reward"]
    markers = next(s.data for s in sources if "move" in s.data)
    assert markers["y"] == ["0", "1"] and markers["B"] == ["2.25", "not planned"]
    html = render(sample_page())
    assert 'http-equiv="refresh"' in html and "planner decisions" in html


@pytest.mark.filterwarnings("error::UserWarning")  # Bokeh warns of ragged columns; that is a bug here
def test_an_empty_page_renders() -> None:
    """A plugin that has seen nothing yet (no devices, no iteration, no report) still gets a page."""
    assert "role of each device" in render(PageData())
