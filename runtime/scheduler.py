"""Which chunks run in the next engine step.

The contract (`Scheduler`): requests queue per stream in FIFO order, a stream has at most one
chunk in flight, one step runs one batch of chunks that share a model and a chunk shape, and
`schedule()` never blocks. `FifoScheduler` serves streams round-robin so that one busy stream
cannot starve the others.
"""

from __future__ import annotations

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


class FifoScheduler(Scheduler):
    """Round-robin over streams, FIFO within a stream, batches of up to `max_batch`."""

    def __init__(self, shape_of: Callable[[str], ChunkShape], max_batch: int = 4) -> None:
        self.shape_of = shape_of  # reads the stream's committed state, so shapes are never stale
        self.max_batch = max_batch
        self._queues: dict[str, deque[ChunkRequest]] = {}
        self._running: set[str] = set()
        self._finished: list[str] = []
        self._rr = 0  # round-robin start

    def add_request(self, request: ChunkRequest) -> None:
        self._queues.setdefault(request.stream_id, deque()).append(request)

    def abort_requests(self, request_ids: set[int]) -> list[ChunkRequest]:
        removed = []
        for sid, q in self._queues.items():
            running_head = q[0] if sid in self._running and q else None
            kept = deque()
            for r in q:
                if r.request_id in request_ids and r is not running_head:
                    removed.append(r)
                else:
                    kept.append(r)
            self._queues[sid] = kept
        return removed

    def finish_stream(self, stream_id: str) -> list[ChunkRequest]:
        dropped = list(self._queues.pop(stream_id, ()))
        self._running.discard(stream_id)
        self._finished.append(stream_id)
        return dropped

    def schedule(self) -> StepPlan:
        plan = StepPlan(finished_stream_ids=self._finished)
        self._finished = []
        ready = [sid for sid, q in self._queues.items() if q and sid not in self._running]
        if not ready:
            return plan
        start = self._rr % len(ready)
        self._rr += 1
        shape: ChunkShape | None = None
        for sid in ready[start:] + ready[:start]:
            s = self.shape_of(sid)
            if shape is None:
                shape = s
                plan.model_id = s.model_id
            elif s != shape:
                continue
            plan.chunks.append(ScheduledChunk(sid, self._queues[sid][0], s.n_latent))
            self._running.add(sid)
            if len(plan.chunks) >= self.max_batch:
                break
        return plan

    def update_from_output(self, plan: StepPlan) -> None:
        for sc in plan.chunks:
            self._running.discard(sc.stream_id)
            q = self._queues.get(sc.stream_id)
            if q and q[0] is sc.request:
                q.popleft()
            if q is not None and not q:
                del self._queues[sc.stream_id]

    def requeue(self, request: ChunkRequest) -> None:
        self._queues.setdefault(request.stream_id, deque()).appendleft(request)

    def has_unfinished(self) -> bool:
        return bool(self._finished) or any(q for sid, q in self._queues.items() if sid not in self._running)

    def pending(self, stream_id: str) -> list[ChunkRequest]:
        return list(self._queues.get(stream_id, ()))
