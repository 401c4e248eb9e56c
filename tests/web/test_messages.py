"""web/messages.py and web/errors.py, grouped by docs/PROTOCOL.md section.

These validate Python values (what the codec hands over after unpacking); the byte-level path
is in test_codec.py.
"""

import json
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from web import messages as m
from web.errors import CloseCode, ErrorCode, ProtocolError, ServerError, close_code


def client(obj: dict[str, Any]) -> m.ClientMessage:
    return m.CLIENT_ADAPTER.validate_python(obj)


def server(obj: dict[str, Any]) -> m.ServerMessage:
    return m.SERVER_ADAPTER.validate_python(obj)


def rejected(obj: dict[str, Any], adapter: Any = m.CLIENT_ADAPTER) -> tuple[Any, ...]:
    """The loc of the first validation error (without the union tag)."""
    with pytest.raises(ValidationError) as info:
        adapter.validate_python(obj)
    return info.value.errors()[0]["loc"][1:]


# -- Transport: one map with a string `type` --------------------------------------------------


def test_every_protocol_type_has_one_model() -> None:
    client_types = [
        "open",
        "action",
        "step",
        "cancel",
        "pause",
        "resume",
        "reset",
        "prompt",
        "fork",
        "ack",
        "ping",
        "close",
        "generate",
        "rewind",  # a v1 addition
        "snapshot",  # v1 additions: save games
        "restore",
    ]
    server_types = [
        "ready",
        "frames",
        "cancelled",
        "prompted",
        "forked",
        "done",
        "pong",
        "error",
        "closed",
        "saved",
    ]
    assert sorted(m.CLIENT_TYPES) == sorted(client_types)
    assert sorted(m.SERVER_TYPES) == sorted(server_types)


def test_unknown_fields_are_rejected() -> None:
    assert rejected({"type": "close", "extra": 1}) == ("extra",)
    assert rejected({"type": "step", "seq": 0, "actions": [{"keys": [], "tilt": 1}]}) == (
        "actions",
        0,
        "tilt",
    )


def test_messages_are_immutable() -> None:
    with pytest.raises(ValidationError):
        m.Cancel(seq=1).seq = 2  # type: ignore[misc]


# -- Client -> server: open -------------------------------------------------------------------


def test_open_defaults() -> None:
    msg = client({"type": "open"})
    assert msg == m.Open(
        model=None, seed=None, prompt=None, image=None, mode="realtime", codec="jpeg", max_ahead=2, token=None
    )


def test_open_all_fields() -> None:
    image = np.zeros((4, 6, 3), np.uint8)
    msg = client(
        {
            "type": "open",
            "model": "tiny",
            "seed": 2**63 - 1,
            "prompt": "a cave",
            "image": image,
            "mode": "lockstep",
            "codec": "h264",
            "max_ahead": 64,
            "token": "s3cret",
            "debug": {"step_delay_ms": 5, "fail_at_chunk": 3},
        }
    )
    assert isinstance(msg, m.Open)
    assert msg.image is image
    assert (msg.mode, msg.codec, msg.max_ahead) == ("lockstep", "h264", 64)
    assert msg.debug == m.DebugHooks(step_delay_ms=5.0, fail_at_chunk=3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "turbo"),
        ("codec", "vp9"),
        ("max_ahead", 0),
        ("max_ahead", 65),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", True),
        ("seed", 1.0),
        ("seed", "1"),
        ("prompt", "x" * 2001),
        ("prompt", b"bytes"),
        ("token", "t" * 513),
        ("model", ""),
        ("debug", {"sleep": 1}),
        ("debug", {"fail_at_chunk": 0}),
        ("image", {"dtype": "uint8", "shape": [1, 1, 3], "data": b"abc"}),  # not unpacked: not an array
        ("image", np.zeros((4, 4, 4), np.uint8)),
        ("image", np.zeros((4, 4), np.uint8)),
        ("image", np.zeros((4, 4, 3), np.float32)),
        ("image", np.zeros((0, 4, 3), np.uint8)),
    ],
)
def test_open_bounds(field: str, value: object) -> None:
    assert rejected({"type": "open", field: value})[0] == field


# -- Client -> server: action, step -----------------------------------------------------------


def test_action() -> None:
    vector = np.array([0.5, -1.0], np.float32)
    msg = client(
        {"type": "action", "seq": 7, "keys": ["w", "space"], "mouse": [1, -2.5], "vector": vector, "t": 12}
    )
    assert isinstance(msg, m.Action)
    assert (msg.seq, msg.keys, msg.mouse, msg.t) == (7, ("w", "space"), (1.0, -2.5), 12.0)
    assert msg.vector is vector


def test_action_defaults_mean_no_input() -> None:
    msg = client({"type": "action", "seq": 0})
    assert (msg.keys, msg.mouse, msg.vector, msg.t) == ((), (0.0, 0.0), None, None)


def test_python_callers_may_pass_tuples_or_lists() -> None:
    assert m.Action(seq=1, keys=["a"], mouse=[1, 2]) == m.Action(seq=1, keys=("a",), mouse=(1.0, 2.0))


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({}, ("seq",)),
        ({"seq": -1}, ("seq",)),
        ({"seq": 2**53}, ("seq",)),
        ({"seq": 1.5}, ("seq",)),
        ({"seq": False}, ("seq",)),
        ({"seq": 0, "keys": ["k"] * 33}, ("keys",)),
        ({"seq": 0, "keys": ["k" * 33]}, ("keys", 0)),
        ({"seq": 0, "keys": [""]}, ("keys", 0)),
        ({"seq": 0, "keys": "w"}, ("keys",)),
        ({"seq": 0, "mouse": [1.0]}, ("mouse", 1)),  # the missing item
        ({"seq": 0, "mouse": [1.0, 2.0, 3.0]}, ("mouse",)),
        ({"seq": 0, "mouse": [float("nan"), 0.0]}, ("mouse", 0)),
        ({"seq": 0, "mouse": [0.0, float("inf")]}, ("mouse", 1)),
        ({"seq": 0, "mouse": ["1", 0.0]}, ("mouse", 0)),
        ({"seq": 0, "mouse": [True, 0.0]}, ("mouse", 0)),
        ({"seq": 0, "t": float("nan")}, ("t",)),
        ({"seq": 0, "vector": np.array([np.nan], np.float32)}, ("vector",)),
        ({"seq": 0, "vector": np.zeros(3, np.int32)}, ("vector",)),
        ({"seq": 0, "vector": np.zeros((2, 2), np.float32)}, ("vector",)),
        ({"seq": 0, "vector": np.zeros(1025, np.float32)}, ("vector",)),
    ],
)
def test_action_bounds(fields: dict[str, Any], loc: tuple[Any, ...]) -> None:
    assert rejected({"type": "action", **fields}) == loc


def test_step_takes_one_action_per_frame_or_one_for_the_chunk() -> None:
    one = client({"type": "step", "seq": 1, "actions": [{}]})
    assert one.actions == (m.FrameAction(),)
    many = client({"type": "step", "seq": 2, "actions": [{"keys": ["a"], "mouse": [0, 1]}] * 256})
    assert len(many.actions) == 256
    assert many.actions[0] == m.FrameAction(keys=("a",), mouse=(0.0, 1.0))


@pytest.mark.parametrize(
    ("actions", "loc"),
    [
        ([], ("actions",)),
        ([{}] * 257, ("actions",)),
        ([{"mouse": [0]}], ("actions", 0, "mouse", 1)),
        ("w", ("actions",)),
    ],
)
def test_step_bounds(actions: object, loc: tuple[Any, ...]) -> None:
    assert rejected({"type": "step", "seq": 0, "actions": actions}) == loc


# -- Client -> server: cancel, pause, resume, reset, fork, ack, ping, close --------------------


@pytest.mark.parametrize("kind", ["cancel", "pause", "resume", "fork"])
def test_seq_only_messages(kind: str) -> None:
    assert client({"type": kind, "seq": 5}).seq == 5
    assert rejected({"type": kind}) == ("seq",)


def test_reset() -> None:
    msg = client({"type": "reset", "seq": 3, "seed": 9, "prompt": "snow"})
    assert (msg.seq, msg.seed, msg.prompt) == (3, 9, "snow")
    assert client({"type": "reset", "seq": 3}).seed is None


def test_ack_ping_close() -> None:
    assert client({"type": "ack", "chunk": 4}).chunk == 4
    assert rejected({"type": "ack", "chunk": -1}) == ("chunk",)
    assert client({"type": "ping", "t": 123.5}).t == 123.5
    assert rejected({"type": "ping"}) == ("t",)
    assert client({"type": "close"}) == m.Close()


# -- Client -> server: generate ----------------------------------------------------------------


def test_generate() -> None:
    msg = client({"type": "generate", "chunks": 3, "actions": [[{"keys": ["w"]}], [{}, {}]], "prompt": "x"})
    assert isinstance(msg, m.Generate)
    assert (msg.chunks, msg.codec, msg.model, msg.seed) == (3, "jpeg", None, None)
    assert msg.actions == ((m.FrameAction(keys=("w",)),), (m.FrameAction(), m.FrameAction()))


def test_generate_actions_entry_is_one_map_or_a_list_of_them() -> None:
    # like step.actions: one action map drives the whole chunk, a list gives one per frame
    msg = client({"type": "generate", "chunks": 3, "actions": [{"keys": ["w"]}, [{"keys": ["d"]}, {}]]})
    assert msg.actions == ((m.FrameAction(keys=("w",)),), (m.FrameAction(keys=("d",)), m.FrameAction()))
    assert m.Generate(chunks=1, actions=[m.FrameAction(keys=("a",))]).actions == (
        (m.FrameAction(keys=("a",)),),
    )
    entry = m.json_schema()["$defs"]["Generate"]["properties"]["actions"]["items"]
    assert [branch.get("type") for branch in entry["anyOf"]] == [None, "array"]
    assert entry["anyOf"][0] == {"$ref": "#/$defs/FrameAction"}


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({}, ("chunks",)),
        ({"chunks": 0}, ("chunks",)),
        ({"chunks": 10_001}, ("chunks",)),
        ({"chunks": 1, "actions": [[{}], [{}]]}, ("actions",)),  # more action lists than chunks
        ({"chunks": 2, "actions": [[]]}, ("actions", 0)),
        ({"chunks": 2, "actions": [[{}] * 257]}, ("actions", 0)),
        ({"chunks": 2, "actions": ["w"]}, ("actions", 0)),  # an entry is an action map or a list of them
        ({"chunks": 2, "actions": [{"tilt": 1}]}, ("actions", 0, 0, "tilt")),  # a map is checked too
    ],
)
def test_generate_bounds(fields: dict[str, Any], loc: tuple[Any, ...]) -> None:
    assert rejected({"type": "generate", **fields}) == loc


# -- Server -> client --------------------------------------------------------------------------

MODEL = {
    "id": "tiny",
    "fps": 16,
    "chunk_frames": 4,
    "width": 64,
    "height": 64,
    "action_space": {"keys": ["w", "a", "s", "d"], "mouse": True, "vector_dim": 0},
}


def test_ready() -> None:
    msg = server(
        {
            "type": "ready",
            "session_id": "s1",
            "resume_token": "tok",
            "protocol": 1,
            "model": MODEL,
            "codec": {"name": "h264", "codec": "avc1.42c00a"},
        }
    )
    assert isinstance(msg, m.Ready)
    assert msg.model.action_space.keys == ("w", "a", "s", "d")
    assert (msg.codec.codec, msg.chunk, msg.protocol) == ("avc1.42c00a", 0, 1)
    assert rejected({**msg.model_dump(), "protocol": 2}, m.SERVER_ADAPTER) == ("protocol",)


def test_ready_frame_is_one_image_in_the_session_codec() -> None:
    base = {"type": "ready", "session_id": "s", "resume_token": "t", "model": MODEL}
    image = np.zeros((64, 64, 3), np.uint8)
    assert server({**base, "codec": {"name": "raw"}}).frame is None  # absent: no frame yet
    assert server({**base, "codec": {"name": "raw"}, "frame": image}).frame is image
    assert server({**base, "codec": {"name": "jpeg"}, "frame": b"\xff\xd8"}).frame == b"\xff\xd8"
    assert server({**base, "codec": {"name": "h264", "codec": "avc1"}, "frame": b"\xff\xd8"}).frame
    assert rejected({**base, "codec": {"name": "jpeg"}, "frame": image}, m.SERVER_ADAPTER) == ()
    assert rejected({**base, "codec": {"name": "raw"}, "frame": b"x"}, m.SERVER_ADAPTER) == ()
    chunk = np.zeros((1, 64, 64, 3), np.uint8)  # a chunk is not one image
    assert rejected({**base, "codec": {"name": "raw"}, "frame": chunk}, m.SERVER_ADAPTER)[0] == "frame"


def test_frames_data_forms() -> None:
    base = {"type": "frames", "chunk": 1, "frame0": 0, "key": True}
    jpeg = server({**base, "count": 2, "codec": "jpeg", "data": [b"a", b"b"], "action_seq": 4})
    assert (jpeg.data, jpeg.action_seq, jpeg.timings) == ((b"a", b"b"), 4, {})
    assert server({**base, "count": 1, "codec": "jpeg", "data": b"a"}).data == b"a"
    raw = np.zeros((2, 4, 4, 3), np.uint8)
    assert server({**base, "count": 2, "codec": "raw", "data": raw}).data is raw


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"count": 2, "codec": "jpeg", "data": [b"a"]}, ()),  # one payload short
        ({"count": 2, "codec": "jpeg", "data": b"ab"}, ()),  # bare bytes only for one frame
        ({"count": 1, "codec": "raw", "data": [b"a"]}, ()),
        ({"count": 2, "codec": "jpeg", "data": np.zeros((2, 4, 4, 3), np.uint8)}, ()),
        ({"count": 1, "codec": "raw", "data": np.zeros((2, 4, 4, 3), np.uint8)}, ()),
        ({"count": 0, "codec": "jpeg", "data": []}, ("count",)),
    ],
)
def test_frames_data_must_match_count_and_codec(fields: dict[str, Any], loc: tuple[Any, ...]) -> None:
    assert (
        rejected({"type": "frames", "chunk": 1, "frame0": 0, "key": True, **fields}, m.SERVER_ADAPTER) == loc
    )


def test_other_server_messages() -> None:
    assert server({"type": "cancelled", "seq": 3, "chunk": 7}) == m.Cancelled(seq=3, chunk=7)
    assert server({"type": "forked", "seq": 1, "session_id": "s2", "resume_token": "t"}).session_id == "s2"
    assert server({"type": "done", "chunks": 2, "frames": 8, "timings": {"total": 9.5}}).timings == {
        "total": 9.5
    }
    assert server({"type": "pong", "t": 1, "server_t": 2.5}) == m.Pong(t=1.0, server_t=2.5)
    assert server({"type": "closed", "reason": "ttl"}).reason == "ttl"


def test_rewind_names_a_chunk_from_zero() -> None:
    msg = m.CLIENT_ADAPTER.validate_python({"type": "rewind", "seq": 3, "chunk": 0})
    assert msg == m.Rewind(seq=3, chunk=0)
    assert rejected({"type": "rewind", "seq": 3, "chunk": -1}) == ("chunk",)
    assert rejected({"type": "rewind", "seq": 3}) == ("chunk",)


# -- Errors -------------------------------------------------------------------------------------


def test_error_codes_are_the_protocols() -> None:
    assert [c.value for c in ErrorCode] == [
        "bad_message",
        "unknown_type",
        "invalid_field",
        "too_large",
        "rate_limited",
        "busy",
        "not_found",
        "unauthorized",
        "internal",
        "not_retained",  # a v1 addition (rewind)
    ]


def test_close_codes() -> None:
    assert [int(c) for c in CloseCode] == [1000, 1008, 1009, 1011, 1013]
    assert close_code(ErrorCode.TOO_LARGE) == CloseCode.TOO_BIG
    assert close_code(ErrorCode.BUSY) == CloseCode.TRY_AGAIN_LATER
    assert close_code(ErrorCode.INTERNAL) == CloseCode.INTERNAL
    assert close_code(ErrorCode.UNAUTHORIZED) == CloseCode.POLICY
    assert {close_code(c) for c in ErrorCode} <= set(CloseCode) - {CloseCode.NORMAL}


def test_error_message_from_and_to_exceptions() -> None:
    exc = ProtocolError(ErrorCode.INVALID_FIELD, "mouse: bad", seq=4, field="mouse")
    msg = m.Error.from_exception(exc)
    assert msg == m.Error(code=ErrorCode.INVALID_FIELD, message="mouse: bad", seq=4, fatal=False)
    assert server({"type": "error", "code": "busy", "message": "full", "fatal": True}).code is ErrorCode.BUSY
    remote = msg.to_exception()
    assert isinstance(remote, ServerError)
    assert (remote.code, remote.seq, remote.fatal, str(remote)) == (
        ErrorCode.INVALID_FIELD,
        4,
        False,
        "invalid_field: mouse: bad",
    )
    assert rejected({"type": "error", "code": "oops", "message": ""}, m.SERVER_ADAPTER) == ("code",)


# -- /v1/protocol.json -----------------------------------------------------------------------


def test_json_schema_lists_every_message() -> None:
    schema = json.loads(json.dumps(m.json_schema()))  # served as JSON
    assert schema["protocol"] == 1
    defs = schema["$defs"]
    titles = {
        defs[ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["const"]
        for ref in schema["client"]["oneOf"]
    }
    assert titles == m.CLIENT_TYPES
    assert set(schema["server"]["discriminator"]["mapping"]) == m.SERVER_TYPES
    assert defs["Open"]["required"] == ["type"]  # `type` has a Python default but is required on the wire
    assert defs["Open"]["additionalProperties"] is False
    image = defs["Open"]["properties"]["image"]["anyOf"][0]
    assert image["required"] == ["dtype", "shape", "data"]
    assert image["properties"]["dtype"]["enum"] == ["uint8"]
    assert defs["Step"]["properties"]["actions"]["maxItems"] == 256
