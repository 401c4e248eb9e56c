"""One chunk = one transaction: begin, stage, then commit or roll back.

begin     reads the committed counters; from here the committed state is read-only.
stage     records what the chunk produced: K/V sit in scratch slots past the committed length
          (or, where the runner defers the clean pass, are written right after commit, before
          anything reads them), the new decoder cache is a private object, frames are on the host.
commit    atomically advances the KV length (eviction is implicit in the ring, sinks stay),
          swaps the decoder cache (and the world's plug-in state; with a prompt switch, the pool
          row the switch was staged in), advances the RNG key and the frame counters, appends to
          the action log, notes the new position in the stream's rewind history
          (runtime/history.py) — and only then is a `ChunkCommitted` (with
          its frames) handed out.
rollback  drops the stage (a prompt switch's staged row goes back to the pool). Nothing
          committed was written, so the world is bit-identical to
          before and the stream can run its next chunk at once.

Where this sits among the planes and how a cancel reaches it: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from models.actions import FrameAction
from models.plugin import PluginState
from models.vae import DecoderCache
from models.world import WorldState
from runtime.history import ChunkHistory
from runtime.requests import ChunkCommitted, ChunkRequest, ChunkTimings, DebugHooks

log = logging.getLogger(__name__)

ACTION_LOG_CHUNKS = 4096  # committed chunks of actions kept per stream (older ones are dropped)


@dataclass
class Stream:
    """The runtime's record of one session's world."""

    stream_id: str
    model_id: str
    state: WorldState  # device state; counters change only in Transaction.commit
    debug: DebugHooks = field(default_factory=DebugHooks)
    action_log: deque[list[FrameAction]] = field(default_factory=lambda: deque(maxlen=ACTION_LOG_CHUNKS))
    fault_fired: bool = False  # DebugHooks.fail_at_chunk fires once
    lost: str | None = None  # why its K/V cannot be trusted (an owed clean pass failed); a reset clears it
    history: ChunkHistory = field(default_factory=lambda: ChunkHistory(0))  # what a rewind returns to


@dataclass
class PromptSwitch:
    """A chunk's prompt switch, staged in a pool row of its own: a copy of the row the chunk would
    have run on, with the new prompt's text K/V (and, re-caching, the kept frames' K/V recomputed
    under it). The chunk runs on that row; its commit makes it the stream's row and frees the old
    one, a rollback frees it, so the old prompt and K/V stay exactly as they were."""

    prompt: str
    row: int  # the staged pool row
    lease: int
    free: Callable[[int, int], None]  # gives a (row, lease) back to the world's pool


class TxnStatus(enum.Enum):
    """Lifecycle of a transaction."""

    OPEN = "open"
    STAGED = "staged"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"


@dataclass
class Staged:
    """What a chunk produced, invisible until commit."""

    n_latent: int  # latent frames written into scratch slots
    decoder: DecoderCache  # decoder cache after this chunk
    frames: np.ndarray  # (T, H, W, 3) uint8 on the host
    timings: ChunkTimings


class Transaction:
    """A chunk in flight for one stream."""

    def __init__(
        self,
        stream: Stream,
        request: ChunkRequest,
        actions: list[FrameAction],
        after: Transaction | None = None,
        n_latent: int = 0,
    ) -> None:
        self.stream = stream
        self.request = request
        self.actions = actions  # per-video-frame actions this chunk applies
        # Pipelined decode: the stream's chunk still decoding, which this one runs on top of. It
        # must commit first; if it does not, this one is rolled back and runs again.
        self.after = after
        self.n_latent = n_latent  # latent frames the chunk adds
        # The session's plug-in state after this chunk (`WorldPlugin.advance`), set by the
        # denoise: its commit installs it, and a chunk run on top reads it.
        self.plugin_state: PluginState | None = None
        self.switch: PromptSwitch | None = None  # set by the runner when the request switches prompts
        if after is None:
            st = stream.state
            self.chunk = st.chunks + 1  # the chunk number a commit would create
            self.latent_start = st.frames
            self.frame0 = st.video_frames
        else:
            self.chunk = after.chunk + 1
            self.latent_start = after.latent_start + after.n_latent
            self.frame0 = after.frame0 + len(after.actions)
        self.status = TxnStatus.OPEN
        self._staged: Staged | None = None

    @property
    def row(self) -> int:
        """The pool row the chunk runs on: its staged switch row, else that of the chunk it runs on
        top of, else its stream's."""
        if self.switch is not None:
            return self.switch.row
        return self.after.row if self.after is not None else self.stream.state.row

    def _set_status(self, status: TxnStatus) -> None:
        log.debug(
            "= txn %s chunk %d: %s -> %s", self.stream.stream_id, self.chunk, self.status.value, status.value
        )
        self.status = status

    def stage(self, staged: Staged) -> None:
        """Record the chunk's outputs."""
        if self.status is not TxnStatus.OPEN:
            raise RuntimeError(f"stage() on a {self.status.value} transaction")
        self._staged = staged
        self._set_status(TxnStatus.STAGED)

    def commit(self) -> ChunkCommitted:
        """Make the chunk part of the world and release its frames."""
        if self.status is not TxnStatus.STAGED or self._staged is None:
            raise RuntimeError(f"commit() on a {self.status.value} transaction")
        st = self.stream.state
        if st.chunks + 1 != self.chunk or st.frames != self.latent_start:
            raise RuntimeError("the stream moved on while this transaction was open")
        s = self._staged
        st.frames += s.n_latent
        st.decoder = s.decoder
        st.chunks += 1
        st.video_frames += s.frames.shape[0]
        st.start_latents = None
        if self.plugin_state is not None:
            st.plugin_state = self.plugin_state
        if self.switch is not None:  # the staged row becomes the stream's; the old one goes back
            sw = self.switch
            sw.free(st.row, st.lease)
            st.row, st.lease, st.prompt = sw.row, sw.lease, sw.prompt
            # The old row and prompt are gone: no rewind can return to before this chunk.
            self.stream.history.clear()
        self.stream.action_log.append(self.actions)
        self.stream.history.record(st, s.frames[-1] if s.frames.shape[0] else None)
        self._set_status(TxnStatus.COMMITTED)
        return ChunkCommitted(
            request_id=self.request.request_id,
            stream_id=self.stream.stream_id,
            chunk=self.chunk,
            frame0=self.frame0,
            frames=s.frames,
            actions=self.actions,
            timings=s.timings,
        )

    def rollback(self) -> None:
        """Drop whatever was staged; hand realtime actions back to their source."""
        if self.status in (TxnStatus.COMMITTED, TxnStatus.ROLLED_BACK):
            raise RuntimeError(f"rollback() on a {self.status.value} transaction")
        self._staged = None
        if self.switch is not None:  # the old prompt and K/V were never touched
            self.switch.free(self.switch.row, self.switch.lease)
            self.switch = None
        if self.request.source is not None:
            self.request.source.give_back(self.actions)
        self._set_status(TxnStatus.ROLLED_BACK)
