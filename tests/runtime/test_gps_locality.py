"""The GPS registry's holdings and fetch-time model reach core's shift-cost model (φ) through
`attach_locality`, whichever of the two scheduler plugins starts last."""

from __future__ import annotations

from types import SimpleNamespace

from pivotrl.core import Role
from pivotrl.core.locality import Holder, Tier
from pivotrl.runtime.gps_plugin import GPSRegistryPlugin, attach_locality
from pivotrl.runtime.scheduler_plugin import PivotSchedulerPlugin
from tests.runtime.test_mechanism import manual, specs


def test_attach_locality_shares_holdings_with_the_controller() -> None:
    gps = GPSRegistryPlugin()
    role_specs = specs()
    role_specs["rollout"]["model"], role_specs["reward"]["model"] = "policy", "genrm"
    main = PivotSchedulerPlugin(manual(["rollout", "reward"]), role_specs, session="t")
    scheduler = SimpleNamespace(plugins={"pivotrl-gps": gps})
    attach_locality(scheduler)  # the pivotrl plugin is not there yet: nothing to do
    costs = main.orch.ctl.shift_costs
    assert costs.locality is None
    scheduler.plugins["pivotrl"] = main
    attach_locality(scheduler)
    loc = costs.locality
    assert loc is not None and loc.holdings is gps.holdings and loc.fetch is gps.fetch
    model = "genrm"
    assert loc.role_models == {Role.ROLLOUT: "policy", Role.REWARD: "genrm"}
    gps.handle_join("tcp://w1", "a")
    gps.handle_join("tcp://w2", "b")
    gps.handle_register(model, 0, "a", Tier.HOST.value, nbytes=10**9)
    assert costs.fetch_delta(["tcp://w1"], Role.REWARD) < costs.fetch_delta(["tcp://w2"], Role.REWARD)
    assert gps.holdings.holders(model, 0) == [Holder("a", "", Tier.HOST)]
