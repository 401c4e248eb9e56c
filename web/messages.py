"""Protocol v1 messages: one pydantic model per message type (docs/PROTOCOL.md).

Like websockets' ``frames.py`` this module only says what a message *is*; turning bytes into
messages and back is :mod:`web.codec`'s job. Every model forbids unknown fields and is strict
(an int field takes no bool, float or string; a float field takes ints but no bools or strings),
and everything a client controls is bounded. Containers accept any sequence from Python callers
(``mouse=(1.0, 2.0)`` or ``[1.0, 2.0]``); on the wire they are msgpack arrays.

Array fields (``open.image``, ``vector``, raw ``frames.data``) hold numpy arrays: the codec
unpacks the wire form ``{dtype, shape, data}`` before validation, and the models check dtype
and shape here. Models are frozen, but numpy arrays compare element-wise, so compare messages
that hold arrays field by field.

``CLIENT_ADAPTER`` / ``SERVER_ADAPTER`` validate the two discriminated unions; ``json_schema()``
is what the server publishes at ``/v1/protocol.json``.
"""

from typing import Annotated, Any, Literal, Self, get_args

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FiniteFloat,
    GetJsonSchemaHandler,
    PlainValidator,
    Strict,
    StringConstraints,
    TypeAdapter,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from web.errors import ErrorCode, ProtocolError, ServerError

__all__ = [
    "CLIENT_ADAPTER",
    "CLIENT_TYPES",
    "PROTOCOL_VERSION",
    "SERVER_ADAPTER",
    "SERVER_TYPES",
    "Ack",
    "Action",
    "ActionSpace",
    "Cancel",
    "Cancelled",
    "ClientMessage",
    "Close",
    "Closed",
    "Codec",
    "CodecInfo",
    "DebugHooks",
    "Done",
    "Error",
    "Fork",
    "Forked",
    "FrameAction",
    "Frames",
    "Generate",
    "Message",
    "Mode",
    "ModelInfo",
    "Open",
    "Pause",
    "Ping",
    "Pong",
    "PromptSwitch",
    "Prompted",
    "Ready",
    "Reset",
    "Restore",
    "Resume",
    "Rewind",
    "Saved",
    "ServerMessage",
    "Snapshot",
    "Step",
    "json_schema",
]

PROTOCOL_VERSION = 1

# Bounds on what a client controls. Integers stop at 2**53 - 1, the largest a JavaScript
# client holds exactly.
MAX_INT = 2**53 - 1
MAX_SEED = 2**63 - 1  # a seed fits a signed 64-bit int (msgpack int64, torch.manual_seed)
MAX_MODEL_ID = 128  # chars
MAX_PROMPT = 2000  # chars
MAX_TOKEN = 512  # chars
MAX_KEYS = 32  # keys held at once
MAX_KEY = 32  # chars per key name
MAX_FRAME_ACTIONS = 256  # actions per chunk (step.actions, one entry of generate.actions)
MAX_CHUNKS = 10_000  # generate.chunks
MAX_AHEAD = 64  # open.max_ahead
MAX_VECTOR = 1024  # length of a continuous action vector
MAX_SIDE = 4096  # pixels per image side
MAX_CHUNK_FRAMES = 256  # frames in one `frames` message
MAX_STEP_DELAY_MS = 60_000  # open.debug.step_delay_ms

Codec = Literal["h264", "jpeg", "raw"]
Mode = Literal["realtime", "lockstep"]

# -- field types ------------------------------------------------------------------------------

Seq = Annotated[int, Field(ge=0, le=MAX_INT)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Positive = Annotated[int, Field(ge=1, le=MAX_INT)]
Chunk = Positive  # chunks are numbered from 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
ModelId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_MODEL_ID)]
Prompt = Annotated[str, StringConstraints(max_length=MAX_PROMPT)]
Token = Annotated[str, StringConstraints(max_length=MAX_TOKEN)]
Key = Annotated[str, StringConstraints(min_length=1, max_length=MAX_KEY)]
# strict=False on a container lets Python callers pass lists or tuples; the items stay strict.
Keys = Annotated[tuple[Key, ...], Field(max_length=MAX_KEYS, strict=False)]
StrictFinite = Annotated[FiniteFloat, Strict()]
Mouse = Annotated[tuple[StrictFinite, StrictFinite], Field(strict=False)]
Timings = dict[str, float]  # milliseconds per stage, e.g. {"denoise": 31.2, "decode": 9.8}

_Side = range(1, MAX_SIDE + 1)
_Dim = int | range  # exact size or allowed range


def _array_type(*, dtypes: tuple[str, ...], shape: tuple[_Dim, ...], finite: bool = False) -> Any:
    """An ndarray field with an allowed dtype subset and shape pattern, published in JSON schema
    as the wire map ``{dtype, shape, data}``."""

    pattern = (
        "(" + ", ".join(f"{d.start}..{d.stop - 1}" if isinstance(d, range) else str(d) for d in shape) + ")"
    )

    def check(value: object) -> np.ndarray:
        if not isinstance(value, np.ndarray):
            raise ValueError("expected an array map {dtype, shape, data}")
        if value.dtype.name not in dtypes:
            raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {value.dtype.name}")
        if value.ndim != len(shape) or not all(
            got in want if isinstance(want, range) else got == want
            for got, want in zip(value.shape, shape, strict=True)
        ):
            raise ValueError(f"shape must be {pattern}, got {value.shape}")
        if finite and not np.isfinite(value).all():
            raise ValueError("values must be finite")
        return value

    schema = {
        "type": "object",
        "description": f"array, little-endian C order, shape {pattern}",
        "properties": {
            "dtype": {"enum": list(dtypes)},
            "shape": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1},
                "minItems": len(shape),
                "maxItems": len(shape),
            },
            "data": {"type": "string", "format": "binary"},
        },
        "required": ["dtype", "shape", "data"],
        "additionalProperties": False,
    }
    return Annotated[np.ndarray, PlainValidator(check), WithJsonSchema(schema)]


Image = _array_type(dtypes=("uint8",), shape=(_Side, _Side, 3))  # (H, W, 3) RGB
Vector = _array_type(
    dtypes=("float16", "float32", "float64"), shape=(range(1, MAX_VECTOR + 1),), finite=True
)  # (D,) continuous action
FramesArray = _array_type(
    dtypes=("uint8",), shape=(range(1, MAX_CHUNK_FRAMES + 1), _Side, _Side, 3)
)  # (T, H, W, 3) RGB


def _type_required(schema: dict[str, Any]) -> None:
    # `type` has a default so Python callers can write Open(...), but on the wire it is required.
    required = schema.setdefault("required", [])
    if "type" not in required:
        required.insert(0, "type")


class _Model(BaseModel):
    """Common config: unknown fields rejected, strict scalars, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Message(_Model):
    model_config = ConfigDict(json_schema_extra=_type_required)


# -- shared sub-models ------------------------------------------------------------------------


class FrameAction(_Model):
    """Input for one frame (or a whole chunk): keys held, mouse delta, optional vector.

    Defaults: no keys, zero mouse, no vector — i.e. "no input".
    """

    keys: Keys = ()  # key names held during the frame, from ready.model.action_space.keys
    mouse: Mouse = (0.0, 0.0)  # (dx, dy) mouse movement over the frame
    vector: Vector | None = None  # (vector_dim,) continuous action, when the model takes one


class DebugHooks(_Model):
    """``open.debug``: test hooks, accepted only when the server runs with ``--debug-hooks``."""

    step_delay_ms: Annotated[float, Field(ge=0, le=MAX_STEP_DELAY_MS)] = 0.0  # sleep per denoise step
    fail_at_chunk: Chunk | None = None  # raise inside the model while generating this chunk


class ActionSpace(_Model):
    """What input a model takes."""

    keys: tuple[str, ...] = Field(strict=False)  # key names the model understands
    mouse: bool  # True: mouse deltas are used
    vector_dim: Count = 0  # length of the continuous action vector; 0 = none


class ModelInfo(_Model):
    """The model a session runs (``ready.model``)."""

    id: str  # registry name
    fps: Annotated[float, Field(gt=0)]  # frames per second of the generated video
    chunk_frames: Positive  # frames per chunk (a first chunk may carry fewer; see frames.count)
    width: Positive  # frame width, pixels
    height: Positive  # frame height, pixels
    action_space: ActionSpace


class CodecInfo(_Model):
    """The frame codec of a session (``ready.codec``)."""

    name: Codec
    codec: str | None = None  # WebCodecs codec string, e.g. "avc1.42c01e"; H.264 only
    # H.264 only: frames are coded at `scale` x the model's width and height (each pixel a
    # scale x scale block); averaging each block gives the model-size frame
    scale: Annotated[int, Field(ge=1, le=8)] | None = None


# -- client -> server -------------------------------------------------------------------------


class Open(_Message):
    """First message of a new session; answered by ``ready``.

    Defaults: ``model`` None = the server's default model; ``seed`` None = the server picks one;
    ``prompt`` None = unconditioned; ``mode`` "realtime"; ``codec`` "jpeg" (decodable
    everywhere, no secure context needed); ``max_ahead`` 2 chunks past the last ack.
    """

    type: Literal["open"] = "open"
    model: ModelId | None = None
    seed: Seed | None = None
    prompt: Prompt | None = None
    image: Image | None = None  # start from this frame, for image-conditioned worlds
    mode: Mode = "realtime"
    codec: Codec = "jpeg"
    max_ahead: Annotated[int, Field(ge=1, le=MAX_AHEAD)] = 2  # realtime credit window, chunks
    token: Token | None = None  # server token when the server requires one
    debug: DebugHooks | None = None


class Action(_Message):
    """Realtime input: latest keys win, mouse deltas add up, applied at the next chunk boundary."""

    type: Literal["action"] = "action"
    seq: Seq
    keys: Keys = ()  # held now
    mouse: Mouse = (0.0, 0.0)  # (dx, dy) since the last action
    vector: Vector | None = None
    t: StrictFinite | None = None  # client clock, ms


class Step(_Message):
    """Lockstep: generate exactly one chunk with these actions (one per frame, or one for all)."""

    type: Literal["step"] = "step"
    seq: Seq
    actions: Annotated[
        tuple[FrameAction, ...], Field(min_length=1, max_length=MAX_FRAME_ACTIONS, strict=False)
    ]


class Cancel(_Message):
    """Abort the in-flight or queued chunk; the committed world is untouched."""

    type: Literal["cancel"] = "cancel"
    seq: Seq


class Pause(_Message):
    """Stop realtime generation."""

    type: Literal["pause"] = "pause"
    seq: Seq


class Resume(_Message):
    """Restart realtime generation."""

    type: Literal["resume"] = "resume"
    seq: Seq


class Reset(_Message):
    """A fresh world in the same session. Defaults: None = keep the session's seed / prompt."""

    type: Literal["reset"] = "reset"
    seq: Seq
    seed: Seed | None = None
    prompt: Prompt | None = None


class PromptSwitch(_Message):
    """Switch a text world's prompt mid-session (an addition to v1, docs/PROTOCOL.md "Prompt
    switching"): answered by ``prompted`` once encoded; the next chunk started after that is
    generated under it, and its ``frames`` carry ``prompt_seq`` = ``seq``."""

    type: Literal["prompt"] = "prompt"
    seq: Seq
    text: Prompt


class Fork(_Message):
    """Copy the committed world into a new detached session (answered by ``forked``)."""

    type: Literal["fork"] = "fork"
    seq: Seq


class Ack(_Message):
    """The client has shown chunk ``chunk`` (flow-control credit; 0 = nothing shown yet)."""

    type: Literal["ack"] = "ack"
    chunk: Count


class Ping(_Message):
    """Liveness / clock probe; answered by ``pong`` echoing ``t``."""

    type: Literal["ping"] = "ping"
    t: StrictFinite  # client clock, ms


class Close(_Message):
    """End the session."""

    type: Literal["close"] = "close"


def _one_or_many(value: object) -> object:
    # One action map (or FrameAction) for a whole chunk reads as a list of one, as in step.actions.
    return (value,) if isinstance(value, dict | FrameAction) else value


class _OneOrManySchema:
    """Publishes a chunk's actions as "one FrameAction, or a list of them" in JSON schema."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        many = handler(core_schema)  # the list form; its `items` is the FrameAction schema
        return {"anyOf": [many["items"], many]}


# One chunk's actions in `generate.actions`: a list of per-frame actions, or one action map.
ChunkActions = Annotated[
    tuple[FrameAction, ...],
    Field(min_length=1, max_length=MAX_FRAME_ACTIONS, strict=False),
    BeforeValidator(_one_or_many),
    _OneOrManySchema(),
]


class Generate(_Message):
    """One-shot: run ``chunks`` chunks with scripted actions, stream ``frames``, then ``done``.

    ``actions[i]`` drives chunk i + 1 exactly like ``step.actions``: a list of per-frame actions,
    or one action map for the whole chunk (held as a list of one); chunks past the end of the
    list get no input. Defaults: ``model``/``seed``/``prompt`` as in ``open``; ``actions`` empty;
    ``codec`` "jpeg". ``token`` is an addition to the v1 table: a server that requires a token
    needs it here too, since ``generate`` replaces ``open``.
    """

    type: Literal["generate"] = "generate"
    model: ModelId | None = None
    seed: Seed | None = None
    prompt: Prompt | None = None
    chunks: Annotated[int, Field(ge=1, le=MAX_CHUNKS)]  # before `actions`: its check reads it
    actions: Annotated[tuple[ChunkActions, ...], Field(max_length=MAX_CHUNKS, strict=False)] = ()
    codec: Codec = "jpeg"
    token: Token | None = None

    @field_validator("actions")
    @classmethod
    def _at_most_one_per_chunk(
        cls, actions: tuple[tuple[FrameAction, ...], ...], info: ValidationInfo
    ) -> tuple[tuple[FrameAction, ...], ...]:
        chunks = info.data.get("chunks")  # absent when `chunks` itself was invalid
        if chunks is not None and len(actions) > chunks:
            raise ValueError(f"{len(actions)} action lists for {chunks} chunks")
        return actions


# -- server -> client -------------------------------------------------------------------------


class Ready(_Message):
    """The session is live. On resume, ``chunk`` is the last committed chunk (0 before any).

    ``frame`` (an addition) is the world's latest committed frame, so a client can show the
    world before its first chunk: the start frame of an image-started world after ``open`` and
    ``reset``, the last frame shown so far on resume; absent when there is none. Raw sessions get
    an (H, W, 3) uint8 array, the others one JPEG. A one-shot's ``ready`` has an empty
    ``resume_token`` (a one-shot cannot be resumed).
    """

    type: Literal["ready"] = "ready"
    session_id: str
    resume_token: str
    protocol: Literal[1] = PROTOCOL_VERSION
    model: ModelInfo
    codec: CodecInfo
    chunk: Count = 0
    frame: Image | bytes | None = None

    @model_validator(mode="after")
    def _frame_matches(self) -> Self:
        if self.frame is not None and isinstance(self.frame, np.ndarray) != (self.codec.name == "raw"):
            raise ValueError("frame: raw sessions carry an array, the others a JPEG")
        return self


class Frames(_Message):
    """One committed chunk of ``count`` frames starting at frame ``frame0``.

    ``data``: for h264 and jpeg, a list with one payload per frame (a bare ``bytes`` is accepted
    when ``count`` is 1); for raw, a (count, H, W, 3) uint8 array. ``key``: the first frame
    is a keyframe (always true for jpeg and raw). ``action_seq``: the last action applied, None
    before any.
    """

    type: Literal["frames"] = "frames"
    chunk: Chunk
    frame0: Count
    count: Annotated[int, Field(ge=1, le=MAX_CHUNK_FRAMES)]
    codec: Codec
    key: bool
    data: bytes | Annotated[tuple[bytes, ...], Field(strict=False)] | FramesArray
    action_seq: Seq | None = None
    timings: Timings = Field(default_factory=dict)
    prompt_seq: Seq | None = None  # the first chunk under the `prompt` switch of this seq

    @model_validator(mode="after")
    def _data_matches(self) -> Self:
        if isinstance(self.data, np.ndarray):
            if self.codec != "raw" or len(self.data) != self.count:
                raise ValueError(f"array data needs codec raw and {self.count} frames")
        elif self.codec == "raw":
            raise ValueError("raw frames carry an array")
        else:
            payloads = len(self.data) if isinstance(self.data, tuple) else 1  # bare bytes: one
            if payloads != self.count:
                raise ValueError(f"{payloads} payloads for {self.count} frames")
        return self


class Cancelled(_Message):
    """Chunk ``chunk`` was rolled back in answer to ``cancel`` ``seq``."""

    type: Literal["cancelled"] = "cancelled"
    seq: Seq
    chunk: Chunk
    prompt_seq: Seq | None = None  # a `prompt` switch a rolled-back chunk carried: dropped


class Prompted(_Message):
    """The ``prompt`` switch ``seq`` is encoded and waits for its chunk: the next chunk started
    is generated under it (its ``frames`` carry ``prompt_seq``)."""

    type: Literal["prompted"] = "prompted"
    seq: Seq


class Forked(_Message):
    """The copy made for ``fork`` ``seq`` exists; attach with ``?resume=resume_token``."""

    type: Literal["forked"] = "forked"
    seq: Seq
    session_id: str
    resume_token: str


class Done(_Message):
    """One-shot finished."""

    type: Literal["done"] = "done"
    chunks: Count
    frames: Count
    timings: Timings = Field(default_factory=dict)


class Pong(_Message):
    """Answer to ``ping``: the client's ``t`` and the server clock (ms)."""

    type: Literal["pong"] = "pong"
    t: float
    server_t: float


class Error(_Message):
    """Something went wrong. Non-fatal: the session is exactly as it was. Fatal: a close follows."""

    type: Literal["error"] = "error"
    code: Annotated[ErrorCode, Field(strict=False)]  # the wire carries the plain string
    message: str
    seq: Seq | None = None  # the client message this answers, when known
    fatal: bool = False

    @classmethod
    def from_exception(cls, exc: ProtocolError) -> "Error":
        """The message the server sends for a protocol error."""
        return cls(code=exc.code, message=exc.message, seq=exc.seq, fatal=exc.fatal)

    def to_exception(self) -> ServerError:
        """The exception a client raises for this message."""
        return ServerError(self.code, self.message, seq=self.seq, fatal=self.fatal)


class Closed(_Message):
    """The server ends the session."""

    type: Literal["closed"] = "closed"
    reason: str


# -- rewind (a v1 addition) -------------------------------------------------------------------


class Rewind(_Message):
    """Roll the committed world back to the end of chunk ``chunk`` (0: the world's start),
    within the server's retention; answered by ``ready`` (``chunk`` and that chunk's last
    ``frame``), or ``error`` ``not_retained`` (non-fatal, nothing changed)."""

    type: Literal["rewind"] = "rewind"
    seq: Seq
    chunk: Count


# -- snapshot and restore (v1 additions) -------------------------------------------------------


class Snapshot(_Message):
    """Save the attached session's whole state as a save game: answered by ``saved`` (or an
    ``error``: ``too_large`` past the server's snapshot size limit). Chunks outstanding when it
    comes commit first (realtime generation waits meanwhile); steps sent before ``saved`` get
    ``rate_limited``. The session goes on."""

    type: Literal["snapshot"] = "snapshot"
    seq: Seq


class Saved(_Message):
    """The save game asked for by ``snapshot`` ``seq``: opaque bytes (a safetensors file with a
    JSON manifest: model, weights hash, checksum) holding the world as committed at ``chunk``.
    It holds no resume token."""

    type: Literal["saved"] = "saved"
    seq: Seq
    chunk: Count
    data: bytes


class Restore(_Message):
    """First message of a new session, like ``open``, made from a save game (``saved.data``):
    answered by ``ready`` with a new ``session_id`` and ``resume_token``, ``chunk`` the saved
    chunk and ``frame`` the saved latest frame; chunk numbers go on from there. ``mode`` and
    ``max_ahead`` default to the saved session's. A save game the server cannot take (damaged
    bytes, a model not loaded, other weights) is a fatal ``invalid_field`` naming ``data`` and
    the reason; no room is ``busy``, as for ``open``."""

    type: Literal["restore"] = "restore"
    data: bytes
    mode: Mode | None = None
    codec: Codec = "jpeg"
    max_ahead: Annotated[int, Field(ge=1, le=MAX_AHEAD)] | None = None
    token: Token | None = None  # server token when the server requires one


# -- unions -----------------------------------------------------------------------------------

ClientMessage = Annotated[
    Open
    | Action
    | Step
    | Cancel
    | Pause
    | Resume
    | Reset
    | PromptSwitch
    | Fork
    | Ack
    | Ping
    | Close
    | Generate
    | Rewind
    | Snapshot
    | Restore,
    Field(discriminator="type"),
]
ServerMessage = Annotated[
    Ready | Frames | Cancelled | Prompted | Forked | Done | Pong | Error | Closed | Saved,
    Field(discriminator="type"),
]
Message = ClientMessage | ServerMessage

CLIENT_ADAPTER: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)
SERVER_ADAPTER: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


def _types(union: Any) -> frozenset[str]:
    members: tuple[type[_Message], ...] = get_args(get_args(union)[0])
    return frozenset(m.model_fields["type"].default for m in members)


CLIENT_TYPES = _types(ClientMessage)  # values of `type` a client may send
SERVER_TYPES = _types(ServerMessage)  # values of `type` a server may send


def json_schema() -> dict[str, Any]:
    """JSON schema of every message, both directions (served at ``/v1/protocol.json``)."""
    client = CLIENT_ADAPTER.json_schema()
    server = SERVER_ADAPTER.json_schema()
    defs: dict[str, Any] = client.pop("$defs")
    for name, schema in server.pop("$defs").items():
        # A model in both unions appears twice with the same schema; a clash would corrupt a $ref.
        if defs.setdefault(name, schema) != schema:
            raise RuntimeError(f"conflicting JSON schemas named {name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"worldserve protocol v{PROTOCOL_VERSION}",
        "description": "Every websocket message is one binary frame holding one msgpack map.",
        "protocol": PROTOCOL_VERSION,
        "client": client,
        "server": server,
        "$defs": defs,
    }
