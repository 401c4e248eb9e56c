"""The outbound queue of one connection: bounded, never blocks a producer, drops frames by policy.

Producers (the connection's pipeline) put encoded messages; the connection's one writer task pops
them and awaits ``send``. A client that reads too slowly makes the queue fill up, and then:

* ``frames`` messages in JPEG or raw (every frame a keyframe) drop the *oldest* queued chunk, so
  the client sees the newest world with bounded latency;
* H.264 ``frames`` drop everything queued (each P-frame needs the one before it) plus every new
  chunk until one that starts with a keyframe, and ask the encoder for that keyframe at once
  (``on_drop``);
* control messages (``ready``, ``error``, ``cancelled``, ...) are never dropped; past
  ``max_control`` of them queued the client is not reading at all and :class:`OutboxOverflow` is
  raised so the connection can be closed.

A one-shot ``generate`` owes the client every frame, so its outbox is ``lossless``: nothing is
dropped, and the producer is held back instead (``Pipeline.room``), which keeps it bounded.

Like websockets' ``Assembler`` this class does no I/O and knows no event loop: it calls
``on_ready`` when there is something to pop and ``on_drop`` when it needs a keyframe.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from web import metrics
from web.errors import WebError
from web.messages import Codec

__all__ = ["Item", "Outbox", "OutboxOverflow"]


class OutboxOverflow(WebError):
    """Too many control messages queued: the client stopped reading."""


@dataclass(frozen=True)
class Item:
    """One queued message, or the request to close the socket after everything before it."""

    data: bytes = b""  # the websocket message (one msgpack map)
    frames: int = 0  # video frames in a `frames` message; 0 for a control message
    key: bool = True  # a decoder can start at this message (always true for control messages)
    close: tuple[int, str] | None = None  # (close code, reason): close instead of sending


class Outbox:
    """Bounded outbound queue of one connection (see the module docstring)."""

    def __init__(
        self,
        *,
        max_chunks: int = 4,
        max_control: int = 1024,
        on_ready: Callable[[], None] = lambda: None,
        on_drop: Callable[[], None] = lambda: None,
        on_pop: Callable[[], None] = lambda: None,
    ) -> None:
        if max_chunks < 1:
            raise ValueError("max_chunks must be >= 1")
        self.codec: Codec = "jpeg"  # the attached session's codec; set when a session attaches
        self.max_chunks = max_chunks  # `frames` messages queued at most
        self.max_control = max_control  # control messages queued at most
        self.on_ready = on_ready  # called when an item is put (wake the writer)
        self.on_drop = on_drop  # called when H.264 frames were dropped (force a keyframe)
        self.on_pop = on_pop  # called when a `frames` item left the queue (room for the producer)
        self.lossless = False  # never drop frames; the producer waits for room instead (one-shots)
        self.dropped = 0  # frames dropped so far
        self._items: deque[Item] = deque()
        self._chunks = 0  # `frames` items queued
        self._awaiting_key = False  # H.264: drop frames until a chunk that starts with a keyframe
        self._closing = False  # a close item is queued; nothing more goes in

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chunks(self) -> int:
        """`frames` messages queued."""
        return self._chunks

    def put_control(self, data: bytes) -> None:
        """Queue a control message. Raises OutboxOverflow past ``max_control`` queued."""
        if self._closing:
            return
        if len(self._items) - self._chunks >= self.max_control:
            raise OutboxOverflow(f"{self.max_control} control messages queued; the client is not reading")
        self._append(Item(data))

    def put_frames(self, data: bytes, frames: int, key: bool) -> None:
        """Queue a `frames` message of ``frames`` video frames; ``key``: it starts with a keyframe."""
        if self._closing:
            return
        if self.lossless:
            self._append(Item(data, frames, key))
            return
        if self.codec != "h264":
            if self._chunks >= self.max_chunks:
                oldest = next(item for item in self._items if item.frames)
                self._drop(lambda item: item is oldest)
            self._append(Item(data, frames, key))
            return
        if self._awaiting_key and not key:
            self._count(frames)
            return
        if self._chunks >= self.max_chunks:
            self._drop(lambda item: item.frames > 0)
            if not key:
                self._count(frames)
                self._awaiting_key = True
                self.on_drop()
                return
        self._awaiting_key = False
        self._append(Item(data, frames, key))

    def put_close(self, code: int, reason: str) -> None:
        """Close the socket with ``code`` once everything queued so far is sent."""
        if not self._closing:
            self._closing = True
            self._append(Item(close=(code, reason)))

    def pop(self) -> Item | None:
        """The next item to send, or None when the queue is empty."""
        if not self._items:
            return None
        item = self._items.popleft()
        if item.frames:
            self._chunks -= 1
            self.on_pop()
        return item

    # -- internals ------------------------------------------------------------------------------

    def _append(self, item: Item) -> None:
        self._items.append(item)
        if item.frames:
            self._chunks += 1
        self.on_ready()

    def _drop(self, doomed: Callable[[Item], bool]) -> None:
        """Remove the queued `frames` items that ``doomed`` picks, counting their frames."""
        kept: deque[Item] = deque()
        for item in self._items:
            if item.frames and doomed(item):
                self._chunks -= 1
                self._count(item.frames)
            else:
                kept.append(item)
        self._items = kept

    def _count(self, frames: int) -> None:
        self.dropped += frames
        metrics.DROPPED_FRAMES.labels(self.codec).inc(frames)
