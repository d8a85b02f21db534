"""`make_policy`: a deployment paradigm by name (the config's `mode`), for the controller and drivers.

Its own module because `shiftable` builds on the policies in `policies` (it runs colocated or a held split
for an iteration when that is predicted faster), so the factory that knows them all sits above both.
"""

from __future__ import annotations

from collections.abc import Mapping

from pivotrl.core.policies import Colocated, Disaggregated, Grouped, Manual, Policy
from pivotrl.core.shiftable import Shiftable
from pivotrl.core.types import PIPELINE, Role

#: The static grouping `make_policy` uses for a disaggregated run on fewer devices than roles: the best
#: 2-device grouping of the CPU paradigms benchmark (rollout alone; reward and train time-share a device).
DEFAULT_GROUPS: tuple[tuple[Role, ...], ...] = ((Role.ROLLOUT,), (Role.REWARD, Role.TRAIN))


def make_policy(mode: str, *, static_split: Mapping[Role | str, int] | None = None,
                initial_split: Mapping[Role | str, int] | None = None,
                groups: list[tuple[tuple[Role | str, ...], int]] | None = None,
                n_devices: int | None = None,
                initial_roles: list[Role | str] | None = None) -> Policy:
    """`colocated` | `disaggregated` | `shiftable` | `grouped` | `manual`.

    `disaggregated` is a static split (`static_split`, or searched) when every role can have a device, and
    the static grouping `groups` otherwise: given `groups`, or given neither a split nor enough devices
    (`n_devices` below the number of roles) the `DEFAULT_GROUPS`, one device per group but the last, which
    takes the rest. `grouped` needs `groups`; `manual` places devices on `initial_roles` in join order. A
    bad mode is a ValueError; the config layer already restricts it."""
    if mode == "disaggregated" and static_split is None and (
            groups or (n_devices is not None and n_devices < len(PIPELINE))):
        mode = "grouped"
        groups = groups or [(g, 1) for g in DEFAULT_GROUPS]
    if mode == "grouped":
        if not groups:
            raise ValueError("mode 'grouped' needs groups=[(roles, devices), ...]")
        return Grouped(groups)
    if mode == "manual":
        return Manual(initial_roles if initial_roles is not None else (Role.ROLLOUT,))
    if mode == "colocated":
        return Colocated(initial_split)
    if mode == "disaggregated":
        return Disaggregated(static_split)
    if mode == "shiftable":
        return Shiftable(initial_split)
    raise ValueError(f"unknown scheduler mode {mode!r}; choose colocated, disaggregated or shiftable")
