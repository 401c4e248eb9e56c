"""web/static/msgpack.js and protocol.js, run in Chromium against the server's own codec
(msgpack-python and web.codec): the page's bytes must be what the server parses, and the
server's bytes what the page reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import pytest

from web import codec
from web import messages as m
from web.server import Server

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.browser

MAX_SAFE = 2**53 - 1  # the largest integer a JavaScript number holds exactly
# run `call` on the argument: "accepted", or what the error thrown says (`what`)
CATCH = "(arg) => {{ try {{ {call}; return 'accepted'; }} catch (e) {{ return e.{what}; }} }}"

# JS helpers: values cross the evaluate() boundary as JSON text (one string: fast), so bin is
# {bin: "hex"} and integers a JS number cannot hold are {big: "digits"}.
HELPERS = """async () => {
  window.mp = await import('/msgpack.js');
  window.proto = await import('/protocol.js');
  const hex = (b) => Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');
  window.unhex = (h) => Uint8Array.from(h.match(/../g) ?? [], (x) => parseInt(x, 16));
  window.norm = (v) => v instanceof Uint8Array ? {bin: hex(v)}
    : typeof v === 'bigint' ? {big: v.toString()}
    : ArrayBuffer.isView(v) ? {typed: v.constructor.name, values: Array.from(v, Number)}
    : Array.isArray(v) ? v.map(norm)
    : v && typeof v === 'object' ? Object.fromEntries(Object.entries(v).map(([k, x]) => [k, norm(x)]))
    : v;
  window.denorm = (v) => Array.isArray(v) ? v.map(denorm)
    : v && typeof v === 'object' && 'bin' in v ? unhex(v.bin)
    : v && typeof v === 'object' && 'big' in v ? BigInt(v.big)
    : v && typeof v === 'object' ? Object.fromEntries(Object.entries(v).map(([k, x]) => [k, denorm(x)]))
    : v;
}"""

CASES: list[Any] = [
    None,
    True,
    False,
    *[0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, MAX_SAFE, 2**53, 2**64 - 1],
    *[-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -MAX_SAFE, -(2**63)],
    *[1.5, -0.25, 1e300, 3.14159],
    *["", "a", "é漢字🙂", "x" * 31, "x" * 32, "x" * 255, "x" * 256, "x" * 70_000],
    *[b"", b"\x00\xff", bytes(range(256)) * 2, bytes(70_000)],
    *[[], [1, [2, [3, []]]], list(range(15)), list(range(16)), list(range(70_000))],
    *[{}, {"a": 1, "b": [b"x", None]}, {f"k{i}": i for i in range(15)}, {f"k{i}": i for i in range(16)}],
    {"type": "frames", "data": [b"\x00\x00\x01\x65", b"\xff"], "timings": {"total": 12.5}},
]


def norm(v: Any) -> Any:
    """A value as the JS helpers render it."""
    if isinstance(v, bytes):
        return {"bin": v.hex()}
    if isinstance(v, bool) or v is None or isinstance(v, float | str):
        return v
    if isinstance(v, int):
        return v if abs(v) <= MAX_SAFE else {"big": str(v)}
    if isinstance(v, list):
        return [norm(x) for x in v]
    return {k: norm(x) for k, x in v.items()}


@pytest.fixture(scope="module")
def js(browser: Browser, server: Server) -> Iterator[Page]:
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.url + "/")
    page.evaluate(HELPERS)
    yield page
    context.close()


def test_msgpack_decodes_what_python_packs(js: Page) -> None:
    packed = [msgpack.packb(v, use_bin_type=True).hex() for v in CASES]
    packed.append(msgpack.packb(1.5, use_single_float=True).hex())  # float32
    got = js.evaluate(
        "(all) => JSON.stringify(JSON.parse(all).map((h) => norm(mp.decode(unhex(h)))))", json.dumps(packed)
    )
    assert json.loads(got) == [norm(v) for v in CASES] + [1.5]


def test_msgpack_encodes_as_python_packs(js: Page) -> None:
    # msgpack-python picks the smallest form of every int, str, bin, array and map: so must we
    values = json.dumps([norm(v) for v in CASES])
    got = js.evaluate("(all) => JSON.parse(all).map((v) => norm(mp.encode(denorm(v))).bin)", values)
    for value, ours in zip(CASES, got, strict=True):
        assert bytes.fromhex(ours) == msgpack.packb(value, use_bin_type=True), repr(value)[:80]


def test_msgpack_drops_undefined_fields_and_encodes_typed_arrays_as_bin(js: Page) -> None:
    got = js.evaluate("() => Array.from(mp.encode({a: 1, b: undefined, c: new Float32Array([1])}))")
    assert msgpack.unpackb(bytes(got)) == {"a": 1, "c": np.float32(1).tobytes()}


@pytest.mark.parametrize(
    "data",
    [
        b"\x92\x01",  # array of 2 with one item
        b"\xd4\x01\x00",  # ext type
        b"\x01\x02",  # trailing bytes
        b"\xc1",  # never used
        b"\x81\x01\x02",  # non-string map key
        b"\xa1\xff",  # invalid UTF-8
        b"\xdd\xff\xff\xff\xff",  # array of 2**32 - 1 items, no data
        b"\xc6\x00\x00\x00\x10\x00",  # bin longer than the data
        b"\x91" * 100 + b"\xc0",  # nested too deeply
    ],
)
def test_msgpack_refuses_malformed_input(js: Page, data: bytes) -> None:
    got = js.evaluate(
        CATCH.format(call="mp.decode(Uint8Array.from(arg))", what="constructor.name"),
        list(data),
    )
    assert got == "MsgpackError"


def test_client_messages_parse_on_the_server(js: Page) -> None:
    wire = js.evaluate(
        """() => {
          const c = proto.client;
          return [
            c.open({model: 'smooth', seed: 7, codec: 'h264', maxAhead: 1, token: 'secret'}),
            c.open(),
            c.action(3, ['d', 'w'], [1.5, -2], 1234.5, [0.25, -1]),
            c.action(4, []),
            c.ack(5), c.pause(6), c.resume(7), c.cancel(8), c.reset(9, 42), c.reset(10),
            c.fork(11), c.ping(12.5), c.close(),
          ].map((msg) => Array.from(proto.pack(msg)));
        }"""
    )
    msgs = [codec.parse_client(bytes(b), max_size=1 << 20) for b in wire]
    assert msgs[0] == m.Open(model="smooth", seed=7, codec="h264", max_ahead=1, token="secret")
    assert msgs[1] == m.Open()
    action = msgs[2]
    assert isinstance(action, m.Action)
    assert (action.seq, action.keys, action.mouse, action.t) == (3, ("d", "w"), (1.5, -2.0), 1234.5)
    assert action.vector is not None and action.vector.dtype == np.float32
    assert action.vector.tolist() == [0.25, -1.0]
    assert msgs[3] == m.Action(seq=4)
    assert msgs[4:] == [
        m.Ack(chunk=5),
        m.Pause(seq=6),
        m.Resume(seq=7),
        m.Cancel(seq=8),
        m.Reset(seq=9, seed=42),
        m.Reset(seq=10),
        m.Fork(seq=11),
        m.Ping(t=12.5),
        m.Close(),
    ]


def test_server_messages_parse_in_the_page(js: Page) -> None:
    model = m.ModelInfo(
        id="w",
        fps=15.0,
        chunk_frames=4,
        width=3,
        height=2,
        action_space=m.ActionSpace(keys=("w",), mouse=True),
    )
    raw = np.arange(2 * 2 * 3 * 3, dtype=np.uint8).reshape(2, 2, 3, 3)
    msgs = [
        m.Ready(
            session_id="s", resume_token="r", model=model, codec=m.CodecInfo(name="h264", codec="avc1.42c00a")
        ),
        m.Frames(
            chunk=2, frame0=1, count=2, codec="jpeg", key=True, data=(b"ab", b"cd"), timings={"total": 1.5}
        ),
        m.Frames(chunk=3, frame0=3, count=1, codec="h264", key=False, data=b"\x00\x00\x01\x41", action_seq=9),
        m.Frames(chunk=4, frame0=4, count=2, codec="raw", key=True, data=raw),
        m.Error(code="invalid_field", message="keys: unknown keys ['q']", seq=3),
        m.Closed(reason="expired"),
    ]
    got = js.evaluate(
        "(all) => all.map((b) => norm(proto.parse(Uint8Array.from(b))))",
        [list(codec.encode(x)) for x in msgs],
    )
    ready, jpeg, h264, raw_frames, error, closed = got
    assert ready["model"]["action_space"] == {"keys": ["w"], "mouse": True, "vector_dim": 0}
    assert ready["codec"] == {"name": "h264", "codec": "avc1.42c00a"} and ready["protocol"] == 1
    assert jpeg["data"] == [{"bin": b"ab".hex()}, {"bin": b"cd".hex()}] and jpeg["timings"] == {"total": 1.5}
    assert "action_seq" not in jpeg  # None is left out on the wire
    assert h264["data"] == [{"bin": "00000141"}] and h264["action_seq"] == 9  # bare bytes: a list of one
    assert raw_frames["data"]["shape"] == [2, 2, 3, 3]
    assert raw_frames["data"]["data"] == {"bin": raw.tobytes().hex()}  # a Uint8Array
    assert error == {
        "type": "error",
        "code": "invalid_field",
        "message": "keys: unknown keys ['q']",
        "seq": 3,
        "fatal": False,
    }
    assert closed == {"type": "closed", "reason": "expired"}


@pytest.mark.parametrize(
    "bad",
    [
        {"dtype": "object", "shape": [1], "data": {"bin": "00"}},
        {"dtype": "uint8", "shape": [2], "data": {"bin": "00"}},  # too little data
        {"dtype": "float32", "shape": [1], "data": {"bin": "00000000"}, "extra": 1},
        {"dtype": "uint8", "shape": [1, 1, 1, 1, 1], "data": {"bin": "00"}},  # five dims
        {"dtype": "constructor", "shape": [1], "data": {"bin": "00"}},  # not an own key of the table
    ],
)
def test_wire_arrays_are_checked(js: Page, bad: dict[str, Any]) -> None:
    got = js.evaluate(
        CATCH.format(call="proto.unpackArray(denorm(arg))", what="constructor.name"),
        bad,
    )
    assert got == "ProtocolError"


def test_frames_with_the_wrong_payload_count_are_refused(js: Page) -> None:
    data = msgpack.packb(
        {"type": "frames", "chunk": 1, "frame0": 0, "count": 3, "codec": "jpeg", "key": True, "data": [b"a"]}
    )
    got = js.evaluate(
        CATCH.format(call="proto.parse(Uint8Array.from(arg))", what="message"),
        list(data),
    )
    assert "expected 3 payloads" in got


def test_ready_frame_parses_in_the_page(js: Page) -> None:
    model = m.ModelInfo(
        id="w", fps=15.0, chunk_frames=4, width=3, height=2, action_space=m.ActionSpace(keys=(), mouse=False)
    )
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    msgs = [
        m.Ready(session_id="s", resume_token="r", model=model, codec=m.CodecInfo(name="raw"), frame=image),
        m.Ready(
            session_id="s", resume_token="r", model=model, codec=m.CodecInfo(name="jpeg"), frame=b"\xff\xd8"
        ),
        m.Ready(session_id="s", resume_token="r", model=model, codec=m.CodecInfo(name="raw")),
    ]
    raw, jpeg, none = js.evaluate(
        "(all) => all.map((b) => norm(proto.parse(Uint8Array.from(b))))",
        [list(codec.encode(x)) for x in msgs],
    )
    assert raw["frame"]["shape"] == [2, 3, 3] and raw["frame"]["data"] == {"bin": image.tobytes().hex()}
    assert jpeg["frame"] == {"bin": "ffd8"}
    assert "frame" not in none
    chunk = codec.pack_array(np.zeros((1, 2, 3, 3), np.uint8))  # a chunk, not one image
    bad = msgpack.packb({**msgpack.unpackb(codec.encode(msgs[2])), "frame": chunk})
    got = js.evaluate(CATCH.format(call="proto.parse(Uint8Array.from(arg))", what="message"), list(bad))
    assert "(H, W, 3) uint8" in got
