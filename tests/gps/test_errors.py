"""User mistakes give one-line `UserError`s that say what exists; hostile names never leave the root."""

from __future__ import annotations

import pytest
import torch

from pivotrl.errors import UserError
from pivotrl.gps import InvalidModelName, NotFoundError, ParameterStore, VersionExistsError


@pytest.fixture
def store(tmp_path):
    with ParameterStore(tmp_path / "gps", write_behind=False) as s:
        s.publish("policy", 1, {"w": torch.ones(3)})
        s.publish("policy", 4, {"w": torch.ones(3)})
        yield s


@pytest.mark.parametrize(
    "name",
    [
        "..",
        "../evil",
        "a/../../b",
        "/etc/passwd",
        "a/b",
        "a\\b",
        "",
        ".hidden",
        "a..b",
        "x\0y",
        "é",
        "a b",
        "a" * 200,
        "~root",
        "-rf",
    ],
)
def test_hostile_or_odd_model_names_are_rejected(store, tmp_path, name):
    for call in (
        lambda: store.publish(name, 9, {"w": torch.ones(1)}),
        lambda: store.fetch(name, 1),
        lambda: store.versions(name),
        lambda: store.gc(name, 1),
        lambda: store.pin(name, 1),
    ):
        with pytest.raises(InvalidModelName) as exc:
            call()
        assert isinstance(exc.value, UserError) and "\n" not in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gps"]


def test_missing_model_lists_models(store):
    with pytest.raises(NotFoundError, match=r"no model 'genrm'.*policy") as exc:
        store.fetch("genrm", 1)
    assert isinstance(exc.value, UserError)
    with pytest.raises(NotFoundError, match="policy"):
        store.latest("genrm")


def test_missing_version_lists_versions(store):
    with pytest.raises(NotFoundError, match=r"no version 2; versions: \[1, 4\]"):
        store.fetch("policy", 2)


def test_unknown_tensor_name_lists_names(store):
    with pytest.raises(NotFoundError, match=r"no tensor\(s\) \[nope\].*\[w\]"):
        store.fetch("policy", 1, names=["nope"])


def test_bad_versions_are_rejected(store):
    for bad in (-1, 1.5, "3", True, None):
        with pytest.raises(InvalidModelName):
            store.publish("policy", bad, {"w": torch.ones(1)})


def test_republishing_a_version_is_an_error(store):
    with pytest.raises(VersionExistsError, match="version 4 already exists"):
        store.publish("policy", 4, {"w": torch.zeros(3)})
    assert torch.equal(store.fetch("policy", 4)["w"], torch.ones(3))


def test_unsupported_dtype_names_the_supported_ones(tmp_path):
    with ParameterStore(tmp_path, write_behind=False) as s, pytest.raises(TypeError, match="bfloat16"):
        s.publish("m", 1, {"c": torch.zeros(2, dtype=torch.complex64)})
