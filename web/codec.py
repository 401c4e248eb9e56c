"""The wire codec of protocol v1: bytes <-> messages, sans I/O. The server and the SDK both use it.

Format choice
-------------
Every message is one binary websocket frame holding one msgpack map with a string ``type``.

* msgpack, not JSON: frames are binary (JPEG, H.264, raw pixels) and msgpack carries them as
  ``bin`` without base64's 33 % and its encode time; it is as schemaless as JSON, so any language
  can speak the protocol with an off-the-shelf library, and maps keep the messages self-describing.
* Arrays travel as ``{"dtype": str, "shape": [int], "data": bin}``, little-endian, C order: a
  layout every client can produce from a typed array (JavaScript ``Float32Array``, numpy
  ``tobytes()``) with no conversion on the common little-endian hosts.
* Never pickle and never a dtype from the wire beyond a fixed allow-list of plain numeric types:
  an ``object`` array built from client bytes is arbitrary memory (it crashed numpy in a public
  server). ``len(data)`` must equal ``prod(shape) * itemsize`` exactly.
* Unpacked arrays are copies: msgpack hands out read-only buffers, and downstream code writes.

Parsing is bounded before any allocation (message size, msgpack string/bin/array/map lengths, ext
types refused) and while msgpack builds the tree: msgpack's hooks count maps and arrays as they are
built and stop at ``MAX_CONTAINERS``, so a megabyte of nested empty arrays costs a few milliseconds,
not the half second it takes to build a million lists. Then nesting depth is checked, and only then
does pydantic validate, over at most ``MAX_CONTAINERS`` objects. Any input at all raises only
:class:`ProtocolError`, with the protocol's error code.
"""

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from pydantic import ValidationError

from web.errors import ErrorCode, ProtocolError
from web.messages import (
    CLIENT_ADAPTER,
    CLIENT_TYPES,
    MAX_CHUNKS,
    MAX_INT,
    SERVER_ADAPTER,
    SERVER_TYPES,
    ClientMessage,
    Message,
    ServerMessage,
)

__all__ = [
    "ALLOWED_DTYPES",
    "MAX_CONTAINERS",
    "MAX_ELEMENTS",
    "ParseCost",
    "encode",
    "pack_array",
    "parse_client",
    "parse_server",
    "unpack_array",
]

# Wire dtype name -> explicit little-endian dtype. int64 is in (seeds, indices; JavaScript has
# BigInt64Array); no unsigned 32/64-bit, complex, strings, datetimes or objects.
ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
MAX_NDIM = 4
MAX_ELEMENTS = 1 << 28  # per array; also bounds each dimension (a zero dim would hide a huge one)

MAX_DEPTH = 16  # nesting of maps/arrays; the deepest v1 message (generate) needs 6
# Maps + arrays per message. Each becomes objects to build and validate (~1-2 us each), so this
# is what bounds the event-loop time of one message (~5 ms; benchmarks/parse_cost.py); a
# `generate` of 1000 chunks with one keyed action each still fits.
MAX_CONTAINERS = 4096
MAX_MAP_LEN = 64  # keys per map; no v1 map has more than a dozen
MAX_ARRAY_LEN = MAX_CHUNKS  # items per msgpack array: generate.actions is the longest

_ARRAY_KEYS = frozenset(("dtype", "shape", "data"))
_MAX_FIELD_CHARS = 64  # a field path echoed in an error message is client text: clip it


def pack_array(a: np.ndarray) -> dict[str, Any]:
    """``{dtype, shape, data}`` for an array: little-endian, C order. Raises ValueError for a
    dtype outside ``ALLOWED_DTYPES`` or more than 4 dimensions."""
    wire = ALLOWED_DTYPES.get(a.dtype.name)
    if wire is None:
        raise ValueError(f"dtype {a.dtype} is not allowed on the wire")
    if a.ndim > MAX_NDIM:
        raise ValueError(f"{a.ndim} dimensions; at most {MAX_NDIM}")
    a = np.ascontiguousarray(a, dtype=wire)  # no copy when already little-endian C order
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}


def unpack_array(obj: object, *, max_elements: int = MAX_ELEMENTS) -> np.ndarray:
    """The (writable, native-order) array a wire map describes.

    Raises ProtocolError(invalid_field) unless ``obj`` is exactly ``{dtype, shape, data}`` with an
    allowed dtype, at most 4 dims each in 0..max_elements, at most ``max_elements`` elements and
    exactly ``prod(shape) * itemsize`` bytes of data (bool bytes must be 0 or 1).
    """

    def bad(reason: str) -> ProtocolError:
        return ProtocolError(ErrorCode.INVALID_FIELD, f"bad array: {reason}")

    if not isinstance(obj, dict) or obj.keys() != _ARRAY_KEYS:
        raise bad("expected a map with exactly dtype, shape, data")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise bad(f"dtype must be one of {', '.join(ALLOWED_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d <= max_elements for d in shape)
    ):
        raise bad(f"shape must be a list of at most {MAX_NDIM} ints in 0..{max_elements}")
    count = math.prod(shape)
    if count > max_elements:
        raise bad(f"{count} elements; at most {max_elements}")
    if not isinstance(data, bytes):
        raise bad("data must be bin")
    wire = ALLOWED_DTYPES[dtype]
    if len(data) != count * wire.itemsize:
        raise bad(f"{len(data)} bytes of data for shape {shape} of {dtype}")
    if dtype == "bool" and data.translate(None, b"\x00\x01"):
        raise bad("bool bytes must be 0 or 1")
    # astype copies: the msgpack buffer is read-only, and this also swaps to native order.
    return np.frombuffer(data, dtype=wire).reshape(shape).astype(wire.newbyteorder("="))


def encode(msg: Message) -> bytes:
    """One message (either direction) as the bytes of one binary websocket frame.

    Fields left at None are omitted; arrays are packed with :func:`pack_array`.
    """
    return msgpack.packb(msg.model_dump(exclude_none=True), default=_pack_default)


def _pack_default(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        return pack_array(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


@dataclass
class ParseCost:
    """What parsing one message took, for callers that charge for it (the rate limiter)."""

    containers: int = 0  # maps + arrays msgpack built (up to MAX_CONTAINERS + 1 when refused)


def parse_client(data: bytes | str, *, max_size: int, cost: ParseCost | None = None) -> ClientMessage:
    """The client message in one websocket frame (a ``str`` is a text frame).

    Raises ProtocolError: ``too_large`` (fatal) over ``max_size`` bytes; ``bad_message`` for a
    text frame, bytes that are not one bounded msgpack map with string keys; ``unknown_type``
    for a missing or unknown ``type``; ``invalid_field`` naming the first bad field. Errors
    carry the message's ``seq`` when it had a valid one (not when unpacking itself failed).
    ``cost``, if given, is filled in whether parsing succeeds or not.
    """
    if isinstance(data, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "text frame; protocol v1 uses binary frames")
    if len(data) > max_size:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"message of {len(data)} bytes; at most {max_size}", fatal=True
        )
    return _parse(data, max_size=max_size, types=CLIENT_TYPES, adapter=CLIENT_ADAPTER, cost=cost)


def parse_server(data: bytes, *, max_size: int | None = None) -> ServerMessage:
    """The server message in one websocket frame (for clients); errors as in :func:`parse_client`."""
    if max_size is not None and len(data) > max_size:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes; at most {max_size}")
    return _parse(data, max_size=len(data), types=SERVER_TYPES, adapter=SERVER_ADAPTER, cost=None)


def _parse(data: bytes, *, max_size: int, types: frozenset[str], adapter: Any, cost: ParseCost | None) -> Any:
    builder = _Builder(cost or ParseCost())
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,  # str is UTF-8 text, bin is bytes
            strict_map_key=True,
            max_str_len=max_size,
            max_bin_len=max_size,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,  # no ext types (timestamps included)
            list_hook=builder.array,
            object_hook=builder.map,
        )
    except _Refused as exc:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, str(exc)) from exc
    except (ValueError, msgpack.UnpackException) as exc:  # every unpack failure is one of these
        reason = str(exc) or type(exc).__name__  # some msgpack errors carry no text
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not one msgpack value: {reason}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "not a msgpack map with string keys")
    seq = obj.get("seq")
    seq = seq if type(seq) is int and 0 <= seq <= MAX_INT else None
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in types:
        reason = "missing type" if kind is None else f"unknown type {_clip(repr(kind))}"
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, reason, seq=seq)
    _check_tree(obj, seq)
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        raise _invalid_field(exc, seq) from exc


class _Refused(Exception):
    """Raised from a msgpack hook; msgpack lets it through, and _parse makes it bad_message."""


@dataclass(frozen=True)
class _BadArray:
    """Stands in for an array map unpack_array refused; _check_tree reports it with its path."""

    reason: str


class _Builder:
    """msgpack hooks, called for each map and array as soon as it is built (innermost first):
    count them against ``MAX_CONTAINERS``, require string keys, and turn every
    ``{dtype, shape, data}`` map into an ndarray."""

    def __init__(self, cost: ParseCost) -> None:
        self.cost = cost

    def _count(self) -> None:
        self.cost.containers += 1
        if self.cost.containers > MAX_CONTAINERS:
            raise _Refused(f"more than {MAX_CONTAINERS} maps and arrays")

    def array(self, items: list[Any]) -> list[Any]:
        self._count()
        return items

    def map(self, obj: dict[Any, Any]) -> Any:
        self._count()
        if not all(type(k) is str for k in obj):
            raise _Refused("map keys must be strings")
        if obj.keys() == _ARRAY_KEYS:
            try:
                return unpack_array(obj)
            except ProtocolError as exc:
                return _BadArray(exc.message)
        return obj


def _check_tree(root: dict[str, Any], seq: int | None) -> None:
    """bad_message past ``MAX_DEPTH``; invalid_field, naming the field, for a refused array.
    One pass over the (at most MAX_CONTAINERS) containers, no copies."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"nested deeper than {MAX_DEPTH}", seq=seq)
        for child in node.values() if type(node) is dict else node:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
            elif type(child) is _BadArray:
                field = _path(_find(root, child) or ())
                raise ProtocolError(ErrorCode.INVALID_FIELD, f"{field}: {child.reason}", seq=seq, field=field)


def _find(node: Any, target: object) -> tuple[str | int, ...] | None:
    """The path from ``node`` to ``target`` (error path only: the tree is known to be shallow)."""
    items = node.items() if type(node) is dict else enumerate(node) if type(node) is list else ()
    for key, child in items:
        if child is target:
            return (key,)
        below = _find(child, target)
        if below is not None:
            return (key, *below)
    return None


def _invalid_field(exc: ValidationError, seq: int | None) -> ProtocolError:
    """invalid_field for the first pydantic error, naming the field by its dotted path."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    field = _path(first["loc"][1:])  # loc[0] is the union tag, i.e. the message type
    reason = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ProtocolError(
        ErrorCode.INVALID_FIELD, f"{field or 'message'}: {reason}{more}", seq=seq, field=field or None
    )


def _path(loc: tuple[str | int, ...]) -> str:
    return ".".join(_clip(str(part)) for part in loc)


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_FIELD_CHARS else text[: _MAX_FIELD_CHARS - 3] + "..."
