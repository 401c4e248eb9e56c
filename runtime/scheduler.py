"""Which chunks run in the next engine step.

The contract (`Scheduler`): requests queue per stream in FIFO order, a stream has at most one
chunk in flight, one step runs one batch of chunks that share a model and a chunk shape, and
`schedule()` never blocks. `FairScheduler` serves the streams that have waited longest first, so
every stream with work gets its turn in a bounded number of steps, whatever its mode.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from runtime.plan import ScheduledChunk, StepPlan
from runtime.requests import ChunkRequest


@dataclass(frozen=True)
class ChunkShape:
    """What a stream's next chunk looks like (decides who can share a batch)."""

    model_id: str  # the stream's world
    n_latent: int  # latent frames the chunk adds


class Scheduler(ABC):
    """Queues chunk requests and forms one batch per step."""

    @abstractmethod
    def add_request(self, request: ChunkRequest) -> None:
        """Queue a request behind the stream's earlier ones."""

    @abstractmethod
    def abort_requests(self, request_ids: set[int]) -> list[ChunkRequest]:
        """Remove queued (not running) requests among `request_ids`; return the removed ones."""

    @abstractmethod
    def finish_stream(self, stream_id: str) -> list[ChunkRequest]:
        """Forget a stream: drop its queue (returned) and report it in the next plan."""

    @abstractmethod
    def schedule(self) -> StepPlan:
        """The next batch (possibly empty)."""

    @abstractmethod
    def update_from_output(self, plan: StepPlan) -> None:
        """The plan's chunks are done (committed, cancelled or failed)."""

    @abstractmethod
    def requeue(self, request: ChunkRequest) -> None:
        """Put a request whose chunk ran but did not finish back at the head of its stream's queue."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether `schedule()` would produce work."""

    @abstractmethod
    def pending(self, stream_id: str) -> list[ChunkRequest]:
        """Requests of the stream that have not finished (queued or running), oldest first."""

    def queued(self, stream_id: str) -> int:
        """How many requests `pending` would return."""
        return len(self.pending(stream_id))

    @abstractmethod
    def waiting(self) -> int:
        """Requests queued and not running, over every stream (for /metrics)."""


class FairScheduler(Scheduler):
    """Longest-waiting stream first, FIFO within a stream, batches of up to `max_batch`.

    A stream is *ready* when it has a queued request and no chunk in flight; ready streams wait
    in one line, in the order they became ready. A step takes the head of the line, and fills
    its batch with the next streams in line that share the head's shape. A stream whose chunk
    finishes and that has more queued joins the back of the line, behind every stream that
    waited meanwhile. So, with N streams with work and one shape, a ready stream is scheduled
    within ceil(N / max_batch) steps; with several shapes (several worlds) each step serves the
    stream that waited longest, so one waits at most N steps. Realtime and lockstep streams
    queue alike: one chunk per turn.
    """

    def __init__(self, shape_of: Callable[[str], ChunkShape], max_batch: int = 4) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        self.shape_of = shape_of  # reads the stream's committed state, so shapes are never stale
        self.max_batch = max_batch
        self._queues: dict[str, deque[ChunkRequest]] = {}
        self._running: set[str] = set()
        # Ready streams, longest-waiting first (a dict keeps insertion order; values unused).
        self._line: dict[str, None] = {}
        self._finished: list[str] = []

    def add_request(self, request: ChunkRequest) -> None:
        sid = request.stream_id
        self._queues.setdefault(sid, deque()).append(request)
        if sid not in self._running:
            self._line.setdefault(sid, None)  # joins the back; a stream already in line keeps its place

    def abort_requests(self, request_ids: set[int]) -> list[ChunkRequest]:
        removed = []
        for sid, q in list(self._queues.items()):
            running_head = q[0] if sid in self._running and q else None
            kept: deque[ChunkRequest] = deque()
            for r in q:
                if r.request_id in request_ids and r is not running_head:
                    removed.append(r)
                else:
                    kept.append(r)
            if kept:
                self._queues[sid] = kept
            else:
                del self._queues[sid]
                self._line.pop(sid, None)
        return removed

    def finish_stream(self, stream_id: str) -> list[ChunkRequest]:
        dropped = list(self._queues.pop(stream_id, ()))
        self._running.discard(stream_id)
        self._line.pop(stream_id, None)
        self._finished.append(stream_id)
        return dropped

    def schedule(self) -> StepPlan:
        plan = StepPlan(finished_stream_ids=self._finished)
        self._finished = []
        if not self._line:
            return plan
        now = time.perf_counter()
        shape: ChunkShape | None = None
        for sid in list(self._line):
            s = self.shape_of(sid)
            if shape is None:
                shape = s  # the longest-waiting stream decides the batch
                plan.model_id = s.model_id
            elif s != shape:
                continue
            request = self._queues[sid][0]
            waited = None
            if not request.scheduled_at:  # a requeued request was counted when it first ran
                request.scheduled_at = now
                waited = now - request.submitted_at if request.submitted_at else None
            plan.chunks.append(ScheduledChunk(sid, request, s.n_latent, waited))
            del self._line[sid]
            self._running.add(sid)
            if len(plan.chunks) >= self.max_batch:
                break
        return plan

    def update_from_output(self, plan: StepPlan) -> None:
        for sc in plan.chunks:
            sid = sc.stream_id
            self._running.discard(sid)
            q = self._queues.get(sid)
            if q and q[0] is sc.request:
                q.popleft()
            if q:
                self._line[sid] = None  # served: to the back of the line
            elif q is not None:
                del self._queues[sid]

    def requeue(self, request: ChunkRequest) -> None:
        # Its turn was spent on a chunk that had to roll back: it goes first again.
        sid = request.stream_id
        self._queues.setdefault(sid, deque()).appendleft(request)
        self._line.pop(sid, None)
        self._line = {sid: None, **self._line}

    def has_unfinished(self) -> bool:
        return bool(self._finished) or bool(self._line)

    def pending(self, stream_id: str) -> list[ChunkRequest]:
        return list(self._queues.get(stream_id, ()))

    def waiting(self) -> int:
        return sum(len(q) - (sid in self._running) for sid, q in self._queues.items())
