"""The `/pivotrl` dashboard page in a real browser: a short run (tiny bootstrap models, two device workers,
core's shiftable planner, held-out accuracy after every iteration), and at its last iteration, while the
cluster is still up, the page opened in headless Chromium: its Bokeh documents render with no JavaScript
error, and what they hold is the run's (every iteration's report on the learning curve, core's decisions
in the table, an iteration line per iteration).

`make browser-test` installs Chromium (Debian's package) and Playwright and runs this test. With
`PIVOTRL_DASHBOARD_SCREENSHOT=<png>` it also saves a full-page screenshot, and with
`PIVOTRL_DASHBOARD_CONFIG=<yaml>` it runs that config (its own storage root and bootstrap cache) instead of
the tiny models: `make dashboard-screenshot` takes the README's from the quickstart that way, since the tiny
judge rewards nothing and its learning curve would be flat.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.runtime.browser import chromium_path
from tests.tiny import tiny_bootstrap

pytestmark = pytest.mark.slow
ITERATIONS = 4


@pytest.fixture
def browser_ready():
    pytest.importorskip("playwright.sync_api", reason="needs playwright: pip install -e '.[browser]'")
    if chromium_path() is None:
        pytest.skip("needs Chromium: apt-get install -y chromium (or PIVOTRL_CHROMIUM=/path/to/chromium)")


@pytest.mark.timeout(1500)  # a fresh tiny bootstrap, then four iterations on a busy two-core machine
def test_the_dashboard_page_renders_in_headless_chromium(browser_ready, tmp_path):
    from pivotrl.run import run_pipeline
    from tests.runtime.browser import check_page

    sets = [
        f"run.iterations={ITERATIONS}",
        "cluster.dashboard_address=127.0.0.1:0",
        "scheduler.mode=shiftable",
        "scheduler.horizon_s=3.0",
        "scheduler.cooldown_s=0.3",
        "scheduler.hysteresis=0.0",
        "scheduler.tick_s=0.1",
    ]
    config = os.environ.get("PIVOTRL_DASHBOARD_CONFIG")
    if config:
        from pivotrl.config import PipelineConfig, load_config

        cfg = load_config(config, PipelineConfig, [*sets, "run.time_budget_s=null"])
    else:
        cfg, boot = tiny_bootstrap(tmp_path, [*sets, "task.eval_prompts=8"])
        cfg.models.policy.path, cfg.models.genrm.path = str(boot.policy_dir), str(boot.judge_dir)
    lines: list[str] = []
    shot = os.environ.get("PIVOTRL_DASHBOARD_SCREENSHOT")
    seen: dict = {}

    def at_iteration(res, row) -> None:
        if res.iteration != ITERATIONS - 1:
            return
        link = next(m.group(1) for ln in lines if (m := re.search(r"dashboard: (\S+)", ln)))
        url = re.sub(r"/status$", "", link.rstrip("/")) + "/pivotrl?refresh=0"
        seen["check"] = check_page(url, Path(shot) if shot else None, timeout_s=120)

    run_pipeline(cfg, workers=2, log=lines.append, progress=False, save_final=False, eval_every=1,
                 on_iteration=at_iteration)
    check = seen["check"]
    assert not check.errors, "\n".join(check.errors + check.warnings)
    assert check.documents >= 1
    assert check.models.get("Span") == 3 * ITERATIONS  # an iteration line on each of the 3 time charts
    assert check.models.get("LegendItem", 0) >= 5  # the role colours: rollout, reward, train, shifting, idle
    curve = next(s for s in check.sources if "accuracy" in s)
    assert curve["iteration"] == list(range(ITERATIONS))  # every iteration's report reached the page
    assert all(a is not None for a in curve["accuracy"])  # each one evaluated (eval_every=1)
    decisions = next(s for s in check.sources if "B" in s and "moves" in s)
    assert decisions["moves"], "core's decisions (at least the first placement) are in the table"
    assert any("→" in c for c in check.cells)  # and the browser drew their rows
    if shot:
        assert Path(shot).stat().st_size < 300_000
