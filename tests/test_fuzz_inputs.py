"""Hostile inputs through the public entry points (hypothesis): whatever a config file or a `--set` value
holds, loading it either succeeds or raises one `UserError` line; never another exception, and the input
file is left unchanged."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.config import PipelineConfig, load_config
from pivotrl.errors import UserError

FIELDS = sorted(
    f"{section}.{name}"
    for section, model in PipelineConfig.model_fields.items()
    for name in model.annotation.model_fields
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from([".inf", "nan", "1e999", "-0", "0x10", "~", "[1, 2]", "{a: 1}"]),
)
SETTINGS = settings(max_examples=300, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _one_line_or_ok(fn) -> None:
    try:
        fn()
    except UserError as exc:
        assert "\n" not in str(exc).strip(), str(exc)


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_any_config_bytes_load_or_fail_in_one_line(raw, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(raw)
    digest = hashlib.sha256(raw).hexdigest()
    _one_line_or_ok(lambda: load_config(path))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


@SETTINGS
@given(
    sets=st.lists(
        st.tuples(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)), SCALARS).map(
            lambda kv: f"{kv[0]}={kv[1]}"
        ),
        max_size=4,
    )
)
def test_any_overrides_load_or_fail_in_one_line(sets, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {iterations: 2}\n")
    _one_line_or_ok(lambda: load_config(path, overrides=sets))
