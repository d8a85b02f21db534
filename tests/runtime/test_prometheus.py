"""`pivotrl_*` metrics on the scheduler dashboard's `/metrics`: scraped before and after work and a shift,
the values move (tokens, shifts by role pair, the phase histogram, the driver's iteration report)."""

from __future__ import annotations

import asyncio

import pytest
from distributed.utils_test import gen_cluster

from pivotrl.runtime.messages import IterationReport, WorkRequest
from tests.runtime.test_plugins import collect_until, rollout_and_reward_workers

pytest.importorskip("prometheus_client")


async def scrape(s) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    from tornado.httpclient import AsyncHTTPClient

    resp = await AsyncHTTPClient().fetch(f"http://localhost:{s.http_server.port}/metrics")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(resp.body.decode()):
        for sample in fam.samples:
            if sample.name.startswith("pivotrl_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90,
             scheduler_kwargs={"dashboard": True, "dashboard_address": ":0"})
async def test_metrics_endpoint_shows_roles_tokens_shifts_and_the_iteration(c, s, a, b):
    plugin = await rollout_and_reward_workers(c, s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    before = await scrape(s)
    assert before["pivotrl_tokens_total{role=rollout}"] == 0
    items = [WorkRequest(f"x{i}", "rollout", {"target_len": 7}, max_new_tokens=7).to_wire() for i in range(4)]
    await c.scheduler.pivotrl_submit(items=items)
    await collect_until(c, {f"x{i}" for i in range(4)})
    judge = next(w for w in plugin.orch.workers.values() if w.role == "reward")
    await c.scheduler.pivotrl_shift(worker=judge.addr, role="train")
    while plugin.orch.workers[judge.addr].role != "train":
        assert loop.time() < deadline + 30
        await asyncio.sleep(0.02)
    report = IterationReport(iteration=3, seconds=1.5, reward_mean=0.25, policy_version=4, judged=10,
                             unparseable=2)
    await c.scheduler.pivotrl_report(report=report.to_wire())
    after = await scrape(s)
    assert after["pivotrl_tokens_total{role=rollout}"] >= 28  # 4 items x 7 tokens
    assert after["pivotrl_shifts_total{dst=train,src=reward}"] == 1
    assert after["pivotrl_shift_phase_seconds_count{phase=total}"] == 1
    assert after[f"pivotrl_device_role{{device={judge.name},role=train}}"] == 1
    assert after["pivotrl_policy_version{}"] == 4 and after["pivotrl_judgments_unparseable_total{}"] == 2
    assert after["pivotrl_reward_mean{}"] == 0.25
