"""Store files damaged at random (hypothesis): any file of a committed version truncated, bit-flipped,
emptied, replaced by junk or removed. A fetch then returns the exact tensors or raises one `UserError` line
naming the model and version; never another exception, never wrong tensors."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.errors import UserError
from pivotrl.gps import ParameterStore
from tests.gps.test_corruption import _sd

OUTCOMES: list[str] = []
DAMAGE = st.sampled_from(["truncate", "flip", "empty", "junk", "remove", "grow"])


@settings(max_examples=120, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    pick=st.integers(0, 10_000), damage=DAMAGE, where=st.floats(0, 1), junk=st.binary(min_size=1, max_size=64)
)
def test_a_damaged_file_is_reported_or_harmless(tmp_path_factory, pick, damage, where, junk):
    root = tmp_path_factory.mktemp("gps")
    sd = _sd()
    with ParameterStore(root, write_behind=False, device_tier_bytes=0) as store:
        store.publish("policy", 1, sd)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    target = files[pick % len(files)]
    raw = target.read_bytes()
    cut = int(where * len(raw))
    if damage == "truncate":
        target.write_bytes(raw[:cut])
    elif damage == "flip" and raw:
        b = bytearray(raw)
        b[min(cut, len(b) - 1)] ^= 0xFF
        target.write_bytes(bytes(b))
    elif damage == "empty":
        target.write_bytes(b"")
    elif damage == "junk":
        target.write_bytes(junk)
    elif damage == "remove":
        target.unlink()
    elif damage == "grow":
        target.write_bytes(raw + junk)
    with ParameterStore(root, write_behind=False, device_tier_bytes=0) as store:
        try:
            got = store.fetch("policy", 1)
        except UserError as exc:
            msg = str(exc)
            OUTCOMES.append("error")
            assert "\n" not in msg and "policy" in msg, msg
            return
    OUTCOMES.append("ok")
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd), (target, damage)


def test_the_fuzz_reached_both_outcomes():
    """Runs after the fuzz (file order): it must have seen damage the store reported and damage that was
    harmless (e.g. junk appended past the data), or it tested nothing."""
    assert {"error", "ok"} <= set(OUTCOMES), OUTCOMES
