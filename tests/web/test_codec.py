"""web/codec.py: bytes in, message or ProtocolError out; grouped by docs/PROTOCOL.md section."""

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from web import codec
from web import messages as m
from web.errors import ErrorCode, ProtocolError

MAX_SIZE = 1 << 20  # the server's inbound limit (websockets' default max_size)


def parse(data: bytes | str) -> m.ClientMessage:
    return codec.parse_client(data, max_size=MAX_SIZE)


def fails(data: bytes | str, code: ErrorCode) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(data)
    assert info.value.code is code, info.value
    return info.value


def pack(obj: object) -> bytes:
    return msgpack.packb(obj)


# -- Dependencies -------------------------------------------------------------------------------


def test_sdk_modules_import_without_torch_or_asyncio() -> None:
    # The SDK runs inside robotics users' processes: the protocol layer must stay light.
    probe = (
        "import sys, web.codec, web.encoders; "
        "banned = {'torch', 'asyncio', 'sessions', 'runtime', 'models'}; "
        "print(sorted(banned & {name.split('.')[0] for name in sys.modules}))"
    )
    root = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


# -- Transport: one binary frame, one msgpack map with string keys and a string `type` ----------


def test_byte_literal_parses() -> None:
    assert parse(b"\x81\xa4type\xa5close") == m.Close()
    assert parse(b"\x82\xa4type\xa4ping\xa1t\xcb\x40\x59\x00\x00\x00\x00\x00\x00") == m.Ping(t=100.0)


@pytest.mark.parametrize(
    "data",
    [
        '{"type": "close"}',  # text frame
        "\x81\xa4type\xa5close",  # the right bytes, but in a text frame
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\x81\xa4type",  # truncated
        b"\x81\xa4type\xa5close\x00",  # trailing data after the map
        b"\x93\x01\x02\x03",  # an array, not a map
        b"\xa5close",  # a string
        b"\x81\x01\xa1x",  # int key
        b"\x81\xc4\x04type\xa5close",  # bin key
        b"\x82\xa4type\xa5close\x81\x01\x02",  # int key in a nested map
        b"\x81\xa4type\xa2\xff\xfe",  # invalid UTF-8
        b"\x81\xa4type\xd6\xff\x00\x00\x00\x00",  # ext type (a timestamp)
        b"\x81\xa4type\xdd\xff\xff\xff\xff",  # array header claiming 2**32 - 1 items
        b"\x91" * 3000 + b"\x80",  # nested deeper than msgpack's own stack
    ],
)
def test_bad_message(data: bytes | str) -> None:
    exc = fails(data, ErrorCode.BAD_MESSAGE)
    assert not exc.fatal


@pytest.mark.parametrize(
    ("data", "seq"),
    [
        (b"\x80", None),  # no type
        (b"\x81\xa4type\x05", None),  # type is not a string
        (b"\x81\xa4type\xa5hello", None),
        (b"\x81\xa4type\xa5ready", None),  # a server message sent by a client
        (b"\x81\xa4type\xa4Open", None),  # types are case-sensitive
        (b"\x82\xa4type\xa4jump\xa3seq\x07", 7),
    ],
)
def test_unknown_type(data: bytes, seq: int | None) -> None:
    assert fails(data, ErrorCode.UNKNOWN_TYPE).seq == seq


def test_too_large_is_fatal() -> None:
    data = pack({"type": "open", "prompt": "x" * MAX_SIZE})
    exc = fails(data, ErrorCode.TOO_LARGE)
    assert exc.fatal
    with pytest.raises(ProtocolError) as info:
        codec.parse_client(b"\x81\xa4type\xa5close", max_size=8)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_unpacking_is_bounded() -> None:
    deep: Any = []
    for _ in range(20):
        deep = [deep]
    fails(pack({"type": "step", "seq": 0, "actions": deep}), ErrorCode.BAD_MESSAGE)
    wide = {"type": "close", **{f"k{i}": i for i in range(64)}}
    fails(pack(wide), ErrorCode.BAD_MESSAGE)  # more keys than any v1 map has
    many = {"type": "generate", "chunks": 10_000, "actions": [[{}] * 7] * 10_000}
    fails(pack(many), ErrorCode.BAD_MESSAGE)  # 70k maps to validate: refused before pydantic


# -- Transport: arrays {dtype, shape, data} -------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(codec.ALLOWED_DTYPES))
def test_array_round_trip(dtype: str) -> None:
    a = (np.arange(24) % 2).astype(dtype).reshape(2, 3, 4)
    wire = codec.pack_array(a)
    assert (wire["dtype"], wire["shape"], len(wire["data"])) == (dtype, [2, 3, 4], a.nbytes)
    b = codec.unpack_array(msgpack.unpackb(msgpack.packb(wire)))
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_array_wire_layout_is_little_endian_c_order() -> None:
    a = np.array([[1, 2], [3, 4]], dtype=">u2").T  # big-endian and Fortran order
    wire = codec.pack_array(a)
    assert wire == {"dtype": "uint16", "shape": [2, 2], "data": bytes([1, 0, 3, 0, 2, 0, 4, 0])}
    b = codec.unpack_array(wire)
    assert b.dtype == np.dtype("uint16") and b.tolist() == [[1, 3], [2, 4]]


def test_unpacked_array_is_a_writable_copy() -> None:
    data = msgpack.unpackb(pack({"dtype": "uint8", "shape": [2], "data": b"\x01\x02"}))
    a = codec.unpack_array(data)
    assert a.flags.writeable and a.flags.c_contiguous
    a[0] = 9
    assert data["data"] == b"\x01\x02"


def test_array_edge_shapes() -> None:
    assert codec.unpack_array({"dtype": "float32", "shape": [], "data": b"\x00\x00\x80\x3f"}) == 1.0
    empty = codec.unpack_array({"dtype": "uint8", "shape": [0, 5], "data": b""})
    assert empty.shape == (0, 5)


@pytest.mark.parametrize(
    "obj",
    [
        {"dtype": "object", "shape": [1], "data": b"\x00" * 8},
        {"dtype": "O", "shape": [1], "data": b"\x00" * 8},
        {"dtype": "<f4", "shape": [1], "data": b"\x00" * 4},  # names only, no byte-order strings
        {"dtype": "uint64", "shape": [1], "data": b"\x00" * 8},
        {"dtype": "complex64", "shape": [1], "data": b"\x00" * 8},
        {"dtype": "U1", "shape": [1], "data": b"\x00" * 4},
        {"dtype": 5, "shape": [1], "data": b"\x00"},
        {"dtype": "uint8", "shape": [3], "data": b"\x00\x00"},  # too short
        {"dtype": "uint8", "shape": [1], "data": b"\x00\x00"},  # too long
        {"dtype": "float32", "shape": [1], "data": b"\x00\x00"},  # itemsize counts
        {"dtype": "uint8", "shape": [-1], "data": b""},
        {"dtype": "uint8", "shape": [True], "data": b"\x00"},
        {"dtype": "uint8", "shape": [1.0], "data": b"\x00"},
        {"dtype": "uint8", "shape": 1, "data": b"\x00"},
        {"dtype": "uint8", "shape": [1, 1, 1, 1, 1], "data": b"\x00"},  # ndim > 4
        {"dtype": "uint8", "shape": [0, 2**40], "data": b""},  # a zero dim hiding a huge one
        {"dtype": "uint8", "shape": [1], "data": "\x00"},  # str, not bin
        {"dtype": "bool", "shape": [2], "data": b"\x01\x02"},
        {"dtype": "uint8", "shape": [1], "data": b"\x00", "order": "F"},
        {"dtype": "uint8", "shape": [1]},
        [1, 2, 3],
    ],
)
def test_array_rejected(obj: object) -> None:
    with pytest.raises(ProtocolError) as info:
        codec.unpack_array(obj)
    assert info.value.code is ErrorCode.INVALID_FIELD


def test_array_element_bound() -> None:
    with pytest.raises(ProtocolError):
        codec.unpack_array({"dtype": "uint8", "shape": [5], "data": b"\x00" * 5}, max_elements=4)


@pytest.mark.parametrize("dtype", ["object", "complex64", "uint32", "datetime64[s]", "<U3"])
def test_pack_array_refuses_dtypes_off_the_list(dtype: str) -> None:
    with pytest.raises(ValueError):
        codec.pack_array(np.zeros(2, dtype=dtype))


def test_arrays_inside_messages_are_numpy() -> None:
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    msg = parse(pack({"type": "open", "image": codec.pack_array(image)}))
    assert isinstance(msg.image, np.ndarray) and np.array_equal(msg.image, image)
    vec = np.array([0.25, -1.0], np.float32)
    step = parse(pack({"type": "step", "seq": 1, "actions": [{"vector": codec.pack_array(vec)}]}))
    assert np.array_equal(step.actions[0].vector, vec)


def test_bad_array_names_its_field() -> None:
    bad = {"dtype": "object", "shape": [1], "data": b"\x00" * 8}
    exc = fails(pack({"type": "step", "seq": 3, "actions": [{}, {"vector": bad}]}), ErrorCode.INVALID_FIELD)
    assert (exc.field, exc.seq) == ("actions.1.vector", 3)
    assert exc.message.startswith("actions.1.vector: bad array: dtype")
    wrong_shape = codec.pack_array(np.zeros((4, 4), np.uint8))
    exc = fails(pack({"type": "open", "image": wrong_shape}), ErrorCode.INVALID_FIELD)
    assert exc.field == "image" and "shape" in exc.message


# -- Client -> server: field validation ------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "field", "seq"),
    [
        ({"type": "close", "seq": 7}, "seq", 7),  # close takes no fields
        ({"type": "ping"}, "t", None),
        ({"type": "action", "seq": 2, "mouse": [0, "1"]}, "mouse.1", 2),
        ({"type": "action", "seq": 2, "mouse": [0, math.inf]}, "mouse.1", 2),
        ({"type": "action", "seq": -2, "keys": []}, "seq", None),  # invalid seq is not echoed
        ({"type": "action", "seq": True}, "seq", None),
        ({"type": "step", "seq": 9, "actions": [{}, {"keys": ["k" * 33]}]}, "actions.1.keys.0", 9),
        ({"type": "open", "codec": "vp9"}, "codec", None),
        ({"type": "open", "prompt": "x" * 2001}, "prompt", None),
        ({"type": "open", "x" * 500: 1}, "x" * 61 + "...", None),  # client text is clipped
        ({"type": "generate", "chunks": 1, "actions": [[{}], [{}]]}, "actions", None),
    ],
)
def test_invalid_field(obj: dict[str, Any], field: str, seq: int | None) -> None:
    exc = fails(pack(obj), ErrorCode.INVALID_FIELD)
    assert (exc.field, exc.seq, exc.fatal) == (field, seq, False)
    assert exc.message.startswith(f"{field}: ")
    assert len(exc.message) < 200


# -- Round trips: encode() then parse ----------------------------------------------------------

IMAGE = np.random.default_rng(0).integers(0, 256, (8, 10, 3), dtype=np.uint8)
CLIENT_MESSAGES: list[m.ClientMessage] = [
    m.Open(),
    m.Open(
        model="tiny",
        seed=3,
        prompt="p",
        mode="lockstep",
        codec="raw",
        max_ahead=4,
        token="t",
        debug=m.DebugHooks(),
    ),
    m.Action(seq=1, keys=("w",), mouse=(0.5, -1.0), t=5.0),
    m.Step(seq=2, actions=(m.FrameAction(keys=("a", "b")), m.FrameAction(mouse=(1.0, 1.0)))),
    m.Cancel(seq=3),
    m.Pause(seq=4),
    m.Resume(seq=5),
    m.Reset(seq=6, seed=1),
    m.PromptSwitch(seq=6, text="a castle at dusk"),
    m.Fork(seq=7),
    m.Ack(chunk=8),
    m.Ping(t=9.5),
    m.Close(),
    m.Generate(chunks=2, actions=((m.FrameAction(),),), codec="h264"),
    m.Rewind(seq=10, chunk=3),
    m.Snapshot(seq=10),
    m.Restore(data=b"\x00save", mode="lockstep", codec="raw", max_ahead=3, token="t"),
]
MODEL = m.ModelInfo(
    id="tiny",
    fps=16.0,
    chunk_frames=4,
    width=64,
    height=64,
    action_space=m.ActionSpace(keys=("w",), mouse=True, vector_dim=2),
)
SERVER_MESSAGES: list[m.ServerMessage] = [
    m.Ready(
        session_id="s", resume_token="r", model=MODEL, codec=m.CodecInfo(name="h264", codec="avc1.42c00a")
    ),
    m.Frames(
        chunk=1,
        frame0=0,
        count=2,
        codec="jpeg",
        key=True,
        data=(b"\xff\xd8", b"\xff\xd9"),
        timings={"a": 1.0},
        prompt_seq=4,
    ),
    m.Cancelled(seq=1, chunk=2),
    m.Cancelled(seq=1, chunk=2, prompt_seq=3),
    m.Prompted(seq=3),
    m.Forked(seq=1, session_id="s2", resume_token="r2"),
    m.Done(chunks=3, frames=12),
    m.Pong(t=1.0, server_t=2.0),
    m.Error(code=ErrorCode.BUSY, message="full", fatal=True),
    m.Closed(reason="bye"),
    m.Saved(seq=10, chunk=4, data=b"\x00save"),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda msg: msg.type)
def test_client_round_trip(msg: m.ClientMessage) -> None:
    assert parse(codec.encode(msg)) == msg


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda msg: msg.type)
def test_server_round_trip(msg: m.ServerMessage) -> None:
    assert codec.parse_server(codec.encode(msg)) == msg


def test_round_trip_with_arrays() -> None:
    opened = parse(codec.encode(m.Open(image=IMAGE)))
    assert np.array_equal(opened.image, IMAGE)
    vec = np.array([1.5, 2.5], np.float64)
    act = parse(codec.encode(m.Action(seq=0, vector=vec)))
    assert act.vector.dtype == np.float64 and np.array_equal(act.vector, vec)
    raw = np.stack([IMAGE, IMAGE[::-1]])
    frames = codec.parse_server(
        codec.encode(m.Frames(chunk=1, frame0=0, count=2, codec="raw", key=True, data=raw))
    )
    assert np.array_equal(frames.data, raw)


def test_encoded_wire_form() -> None:
    # None fields are left out; the error code is a plain string; arrays are {dtype, shape, data}.
    assert msgpack.unpackb(codec.encode(m.Open())) == {
        "type": "open",
        "mode": "realtime",
        "codec": "jpeg",
        "max_ahead": 2,
    }
    assert msgpack.unpackb(codec.encode(m.Error(code=ErrorCode.BUSY, message="x", seq=2))) == {
        "type": "error",
        "code": "busy",
        "message": "x",
        "seq": 2,
        "fatal": False,
    }
    wire = msgpack.unpackb(codec.encode(m.Action(seq=0, vector=np.array([1.0], np.float32))))
    assert wire["vector"] == {"dtype": "float32", "shape": [1], "data": b"\x00\x00\x80\x3f"}


def test_parse_server_errors() -> None:
    with pytest.raises(ProtocolError) as info:
        codec.parse_server(codec.encode(m.Close()))  # a client message
    assert info.value.code is ErrorCode.UNKNOWN_TYPE
    with pytest.raises(ProtocolError) as info:
        codec.parse_server(b"\x81\xa4type\xa4pong")
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, "t")
    with pytest.raises(ProtocolError) as info:
        codec.parse_server(codec.encode(m.Closed(reason="x")), max_size=4)
    assert info.value.code is ErrorCode.TOO_LARGE


# -- Fuzz: parse_client returns a message or raises ProtocolError, nothing else --------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
)


def _trees(keys: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        _scalars,
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
        max_leaves=30,
    )


_values = _trees(st.text(max_size=8) | st.integers(-(2**63), 2**64 - 1))  # any msgpack value
_wire_arrays = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*codec.ALLOWED_DTYPES, "object", "<f4", "uint64"]) | _scalars,
        "shape": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=6) | _values,
        "data": st.binary(max_size=64) | _scalars,
    }
)
_real_arrays = hnp.arrays(
    st.sampled_from(["uint8", "float32", "int16", "bool"]),
    hnp.array_shapes(min_dims=0, max_dims=4, max_side=4),
).map(codec.pack_array)
_arrays = _wire_arrays | _real_arrays
# Plausible values, so that some maps get past the first field check and some parse.
_plausible = (
    st.integers(min_value=-1, max_value=300)
    | st.lists(st.floats(), min_size=2, max_size=2)
    | st.lists(st.sampled_from(["w", "a", "", "x" * 33]), max_size=3)
    | st.sampled_from(["realtime", "lockstep", "jpeg", "h264", "raw", "tiny"])
)
_frame_actions = st.fixed_dictionaries(
    {}, optional={"keys": _plausible | _values, "mouse": _plausible | _values, "vector": _arrays}
)
_junk = (
    _plausible
    | _trees(st.text(max_size=8))
    | _arrays
    | st.lists(_frame_actions, max_size=3)
    | st.lists(st.lists(_frame_actions, max_size=2), max_size=2)
)


_MODELS = {msg.type: type(msg) for msg in CLIENT_MESSAGES}


def _typed_map(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    """Maps of one type whose keys are mostly that message's own fields (some valid, some junk)."""
    fields = sorted(set(_MODELS[kind].model_fields) - {"type"}) or ["seq"]
    return st.dictionaries(st.sampled_from(fields) | st.text(max_size=5), _junk, max_size=4).map(
        lambda obj: {**obj, "type": kind}
    )


_typed_maps = st.sampled_from(sorted(m.CLIENT_TYPES)).flatmap(_typed_map)


def _parses_or_protocol_error(data: bytes) -> None:
    try:
        msg = parse(data)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        assert msg.type in m.CLIENT_TYPES


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(data: bytes) -> None:
    _parses_or_protocol_error(data)


@FUZZ
@given(_values)
def test_fuzz_random_msgpack(obj: object) -> None:
    _parses_or_protocol_error(msgpack.packb(obj))


@FUZZ
@given(_typed_maps)
def test_fuzz_typed_maps_with_junk_fields(obj: dict[str, Any]) -> None:
    _parses_or_protocol_error(msgpack.packb(obj))


def test_the_container_budget_stops_msgpack_early() -> None:
    inner: list[Any] = [[]] * 10_000
    huge = pack({"type": "ping", "t": 1.0, "x": [inner] * 100})  # ~1M empty arrays in 1 MB
    cost = codec.ParseCost()
    with pytest.raises(ProtocolError) as info:
        codec.parse_client(huge, max_size=len(huge), cost=cost)
    assert info.value.code is ErrorCode.BAD_MESSAGE
    assert cost.containers == codec.MAX_CONTAINERS + 1  # not a million: msgpack stopped there
    wide = pack({"type": "generate", "chunks": 8000, "actions": [[{}] * 7] * 8000})  # 64 KB
    fails(wide, ErrorCode.BAD_MESSAGE)
    fits = {"type": "generate", "chunks": 1000, "actions": [[{"keys": ["w"], "mouse": [1.0, 0.0]}]] * 1000}
    cost = codec.ParseCost()
    msg = codec.parse_client(pack(fits), max_size=MAX_SIZE, cost=cost)
    assert isinstance(msg, m.Generate) and len(msg.actions) == 1000 and cost.containers == 4002
