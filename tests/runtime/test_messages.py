"""The wire form of the runtime's messages: a round trip keeps every field and type, and a message that is
missing a field, carries an unknown one or a value of the wrong type is refused at the seam."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import ShiftTimings
from pivotrl.runtime.messages import (
    GradResult,
    GradStats,
    ItemResult,
    Partial,
    Progress,
    ShiftCommand,
    ShiftDone,
    StepSample,
    SyncReply,
    SyncReport,
    WorkItem,
    WorkRequest,
)

ids = st.text(min_size=1, max_size=8)
toks = st.lists(st.integers(0, 50_000), max_size=6)
lps = st.lists(st.floats(-50, 0), max_size=6)
secs = st.floats(0, 100)
results = st.builds(ItemResult, ids, toks, lps, st.sampled_from(["", "stop", "length"]))
timings = st.builds(ShiftTimings, secs, secs, secs, secs, secs, st.booleans())
grads = st.builds(GradResult, ids, st.integers(0, 9), st.lists(ids, max_size=4),
                  st.builds(GradStats, st.integers(0, 99), st.integers(0, 9), st.integers(0, 9),
                            st.floats(-9, 9), nonfinite=st.booleans()), ids, secs)
reports = st.builds(
    SyncReport, ids, ids, st.integers(0, 64), secs, st.lists(results, max_size=3),
    st.lists(st.builds(Partial, ids, toks, lps), max_size=3),
    st.lists(st.builds(Progress, ids, st.integers(0, 9), toks, lps), max_size=3),
    st.lists(st.builds(StepSample, st.integers(0, 64), secs, st.integers(0, 999)), max_size=3),
    st.none() | grads,
    st.none() | st.builds(ShiftDone, ids, st.none() | st.sampled_from(["rollout", "train"]),
                          st.none() | st.just("reward"), timings),
)
replies = st.builds(
    SyncReply,
    st.lists(st.builds(WorkItem, ids, st.just("rollout"), st.just({"k": 1}), st.integers(0, 3), toks, lps,
                       st.integers(0, 3)), max_size=3),
    st.lists(ids, max_size=3),
    st.none() | st.builds(ShiftCommand, ids, st.none() | st.just("train"), st.just({"version": 1}),
                          st.none() | st.just("rollout"), ids),
    st.booleans(), st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(reports, replies)
def test_round_trip_through_msgpack_keeps_everything(report: SyncReport, reply: SyncReply) -> None:
    for msg in (report, reply):
        wire = msgpack.unpackb(msgpack.packb(msg.to_wire()), use_list=False)  # tuples, as comms hand over
        assert type(msg).from_wire(wire) == msg


def test_a_bad_message_is_refused_naming_the_field() -> None:
    req = WorkRequest("a", "rollout", {"x": 1}, max_new_tokens=4).to_wire()
    assert WorkRequest.from_wire(req).max_new_tokens == 4
    with pytest.raises(ValueError, match="unknown field"):
        WorkRequest.from_wire({**req, "est_tokenz": 3})
    with pytest.raises(TypeError, match="WorkRequest"):
        WorkRequest.from_wire({k: v for k, v in req.items() if k != "role"})
    with pytest.raises(TypeError, match="expected int"):
        WorkRequest.from_wire({**req, "max_new_tokens": "4"})
    with pytest.raises(ValueError, match="must be >= 0"):
        WorkRequest.from_wire({**req, "est_tokens": -1})
    done = ShiftDone("s1", "train", None, ShiftTimings(load=1.0)).to_wire()
    with pytest.raises(ValueError, match="unknown field.*total"):  # a total is derived, never sent
        ShiftDone.from_wire({**done, "timings": {**done["timings"], "total": 1.0}})
    with pytest.raises(ValueError, match="shift phase"):
        ShiftDone.from_wire({**done, "timings": {**done["timings"], "fetch": -1.0}})


plain = st.one_of(st.integers(-9, 9), st.floats(allow_nan=False), st.text(max_size=3), st.booleans(),
                  st.none())
values = st.recursive(
    plain | st.builds(StepSample, st.integers(0, 64), secs, st.integers(0, 999)),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=20,
)


def _encode_by_element(value):
    """The element-by-element reference that `encode`'s one-pass check for plain lists must agree with."""
    if type(value) in (int, float, str, bool, type(None)):
        return value
    if isinstance(value, StepSample):
        return {k: _encode_by_element(v) for k, v in value.__dict__.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_by_element(v) for v in value]
    return {k: _encode_by_element(v) for k, v in value.items()}


@settings(max_examples=300, deadline=None)
@given(values)
def test_encode_agrees_with_encoding_element_by_element(value) -> None:
    from pivotrl.runtime.messages import encode

    assert encode(value) == _encode_by_element(value)


def test_scalar_lists_decode_to_their_type_and_refuse_others() -> None:
    from pivotrl.runtime.messages import decode

    assert decode(list[int], (1, 2)) == [1, 2]
    floats = decode(list[float], [1, 0.5])
    assert floats == [1.0, 0.5] and all(type(v) is float for v in floats)
    for hint, bad in ((list[int], [1, True]), (list[int], [1, 2.0]), (list[str], ["a", 1]),
                      (tuple[float, ...], (0.5, "x"))):
        with pytest.raises(TypeError):
            decode(hint, bad)


payload_values = st.recursive(
    plain,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)
payloads = st.dictionaries(st.text(max_size=4), payload_values, max_size=4)


@settings(max_examples=200, deadline=None)
@given(payloads, toks, lps)
def test_a_payload_off_the_wire_goes_on_as_it_came(payload, generated, logprobs) -> None:
    """The scheduler decodes a request and hands its payload on in a `WorkItem`: the payload is not encoded
    again, and what the worker gets is what the driver sent."""
    from pivotrl.runtime.messages import WireMapping, encode

    wire = msgpack.unpackb(msgpack.packb(WorkRequest("a", "rollout", payload).to_wire()), use_list=False)
    req = WorkRequest.from_wire(wire)
    assert type(req.payload) is WireMapping and req.payload == wire["payload"]
    item = WorkItem(req.id, req.role, req.payload, 0, generated, logprobs)
    sent = item.to_wire()
    assert sent["payload"] is req.payload  # passed on, not rebuilt
    got = WorkItem.from_wire(msgpack.unpackb(msgpack.packb(sent), use_list=False))
    assert encode(dict(got.payload)) == encode(payload)
    assert got == WorkItem.from_wire(msgpack.unpackb(msgpack.packb(
        WorkItem("a", "rollout", payload, 0, generated, logprobs).to_wire()), use_list=False))
