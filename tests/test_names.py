"""User names that become paths, checked with inputs the rule was not written for (hypothesis): a name
the rule accepts is always one harmless path component, and the config refuses every other name in one
line naming the field, before anything is created."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.config import load_config
from pivotrl.errors import UserError
from pivotrl.gps.errors import InvalidModelName
from pivotrl.gps.manifest import validate_model_name
from pivotrl.names import is_safe_name

NASTY = st.one_of(
    st.text(max_size=40),
    st.sampled_from([".", "..", "../x", "a/..", "/abs", "a\n", "x\x00y", ".hidden", "a" * 129, "-a", " a"]),
    st.builds(lambda a, b: a + b, st.sampled_from(["ok", "run", "a.b"]), st.text(max_size=3)),
)


@settings(max_examples=2000, derandomize=True, deadline=None)
@given(name=NASTY)
def test_an_accepted_name_is_one_harmless_path_component(name, tmp_path_factory):
    if not is_safe_name(name):
        with pytest.raises(InvalidModelName):
            validate_model_name(name)
        return
    root = Path("/srv/storage")
    joined = root / name
    assert joined.parent == root and os.path.normpath(joined) == str(joined)
    assert not any(c in name for c in "/\\\x00\n\r\t ") and not name.startswith((".", "-"))
    assert validate_model_name(name) == name


@settings(max_examples=200, derandomize=True, deadline=None)
@given(name=NASTY, field=st.sampled_from(["run.name", "models.policy.name", "models.genrm.name"]))
def test_the_config_refuses_unsafe_names_naming_the_field(name, field, tmp_path_factory):
    import json

    cfg = tmp_path_factory.mktemp("cfg") / "c.yaml"
    *path, last = field.split(".")
    data: dict = {}
    node = data
    for part in path:
        node = node.setdefault(part, {})
    node[last] = name
    cfg.write_text(json.dumps(data))  # JSON is YAML: any string survives the round trip
    if is_safe_name(name):
        assert load_config(cfg) is not None
    else:
        with pytest.raises(UserError) as exc:
            load_config(cfg)
        assert str(exc.value).startswith(f"{cfg}: {field}: ")
