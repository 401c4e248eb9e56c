"""The engine: one device, its worlds and streams, stepped one batch at a time.

`Engine` is the synchronous core (tests drive it in-process). Every call but `abort` and
`is_aborted` belongs to the thread that steps it. `EngineThread` runs an `Engine` on its own
thread and hands results to asyncio as futures, so the event loop never runs a model::

    while running:
        drain_inputs()          # submits, control calls (add/fork/reset/remove), in order
        outcomes = engine.step()
        deliver(outcomes)       # loop.call_soon_threadsafe -> future.set_result

An open or reset of a world with heavy conditioning (`World.heavy_conditioning`) computes it on
the conditioning worker (runtime/conditioning.py) while the engine steps on; `step` installs the
result at its start, between two batches, and only then answers the open or reset
(`Engine.open_stream`, `Engine.begin_reset`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from models.actions import FrameAction
from models.registry import UnknownModelError
from models.world import Conditioning, ConditioningError, ModelSpec, PreparedConditioning, World
from runtime import metrics
from runtime.conditioning import CONDITIONING_NICE, ConditioningJob, ConditioningWorker
from runtime.errors import CapacityError, EngineDeadError, InvalidRequest, StreamNotFound
from runtime.memory import DeviceMemory
from runtime.plan import StepPlan
from runtime.prompt_worker import PromptWorker
from runtime.requests import (
    ChunkCancelled,
    ChunkCommitted,
    ChunkFailed,
    ChunkRequest,
    DebugHooks,
    Outcome,
)
from runtime.runner import BoundaryHook, Runner, RunnerOutput, ring_slack
from runtime.scheduler import ChunkShape, FairScheduler, Scheduler
from runtime.snapshot import Snapshot, SnapshotError, check_world, decode, encode
from runtime.throughput import BatchTimer, ThroughputMeter
from runtime.transaction import Stream

log = logging.getLogger(__name__)
T = TypeVar("T")
# The answer to an open or reset: its stream's info, or the error; called once, on the engine thread.
Reply = Callable[["StreamInfo | Exception"], None]

# At interpreter exit, how long an engine thread nobody stopped gets to leave its model call.
EXIT_GRACE_S = 10.0


@dataclass(frozen=True)
class StreamInfo:
    """A stream's committed position (read on the engine thread)."""

    stream_id: str
    model_id: str
    chunks: int  # committed chunks
    latent_frames: int  # committed latent frames (KV length)
    video_frames: int  # committed video frames
    kv_bytes: int  # device bytes of its K/V pool row
    session_bytes: int  # device bytes charged for it: its row and its plug-in state (runtime/memory.py)
    frame: np.ndarray | None = field(default=None, repr=False)  # (H, W, 3) uint8 start frame, if prefilled


@dataclass
class _Preparing:
    """An open or reset whose conditioning is being computed (`ConditioningWorker`)."""

    kind: Literal["add", "reset"]
    model_id: str
    cond: Conditioning
    debug: DebugHooks
    reply: Reply
    job: ConditioningJob


class Engine:
    """Streams, a scheduler and a runner for one device."""

    def __init__(
        self,
        worlds: dict[str, World],
        *,
        max_batch: int = 4,
        max_streams: int | None = 16,
        max_kv_bytes: int | None = None,
        max_queued_per_stream: int = 8,
        boundary_hook: BoundaryHook | None = None,
        scheduler: Scheduler | None = None,
        pipeline: bool | None = None,
        defer_context: bool | None = None,
        retention: int = 0,
        deterministic: bool = False,
        offload_conditioning: bool = True,
        max_preparing: int | None = None,
        conditioning_threads: int = 1,
        conditioning_nice: int = CONDITIONING_NICE,
    ) -> None:
        """`max_kv_bytes`: the device budget of every world's sessions together, pools included
        (runtime/memory.py); `max_streams`: the budget holds that many sessions of the largest
        world (with both: the smaller budget). Admission is by bytes.
        `pipeline`: decode each batch on a side stream while the next batch denoises (see
        runtime/runner.py); None (the default) turns it on when a world runs on CUDA.
        `defer_context`: run each chunk's clean pass after its frames are out (runtime/runner.py);
        None (the default) defers when not pipelined.
        `retention`: chunks a stream can be rewound by (`rewind_stream`, runtime/history.py);
        each session's charge grows by that many chunks of ring slack and checkpoints.
        `deterministic`: a session's frames do not depend on which sessions share its batch:
        every batch runs padded to `max_batch`, each entry attending and decoding on its own
        (docs/ENGINE.md, "Reproducibility").
        `offload_conditioning`: `open_stream` / `begin_reset` of a world with heavy conditioning
        compute it on a worker thread while the engine steps on (runtime/conditioning.py), at
        most `max_preparing` at once (None: as many as `max_streams`, at least 4: every session
        the budget admits may be opening at once), with `conditioning_threads` torch threads at
        `conditioning_nice` lower CPU priority; False: on the engine's thread, every other chunk
        waiting for it."""
        self.worlds = worlds
        self.retention = retention
        if pipeline is None:
            pipeline = any(w.device.type == "cuda" for w in worlds.values())
        self.pipeline = pipeline
        self._lock = threading.Lock()  # guards _live and _aborted (touched from other threads)
        self._live: set[int] = set()  # request ids handed out and not yet resolved or forgotten
        self._aborted: set[int] = set()  # subset of _live to cancel
        self._ids = itertools.count(1)
        for name, world in worlds.items():
            if world.buckets is not None and max_batch > world.buckets[-1]:
                raise ValueError(f"max_batch {max_batch} exceeds {name}'s largest compiled bucket")
        # Pipelined, every pool row has a chunk of ring slack (runtime/kv_cache.py); a retention
        # of R chunks adds R chunks of it (runtime/history.py).
        slack = {name: ring_slack(w.chunk_frames, pipeline, retention) for name, w in worlds.items()}
        self.memory = DeviceMemory(
            worlds,
            max_kv_bytes,
            max_sessions=max_streams,
            slack_frames=slack,
            settle=self._settle,
            retention=retention,
        )
        self.runner = Runner(
            worlds,
            self.is_aborted,
            boundary_hook,
            pipeline=pipeline,
            defer_context=defer_context,
            retention=retention,
            fixed_batch=max_batch if deterministic else None,
        )
        self.scheduler = scheduler or FairScheduler(self._shape_of, max_batch)
        self.max_queued = max_queued_per_stream
        self._side_outcomes: list[Outcome] = []  # produced by control calls; returned by the next step()
        self.throughput = ThroughputMeter()  # measured chunks/s per world (admission reads it)
        self._timing: BatchTimer | None = None  # the last batch, until the next one starts
        # Called on the worker when a conditioning is ready (EngineThread: wakes its thread).
        self.wake: Callable[[], None] = lambda: None
        self.conditioning = (
            ConditioningWorker(
                max_preparing if max_preparing is not None else max(4, max_streams or 0),
                conditioning_threads,
                wake=lambda: self.wake(),
                nice=conditioning_nice,
            )
            if offload_conditioning
            else None
        )
        self._preparing: dict[str, _Preparing] = {}  # stream id -> its open or reset being prepared

    # -- thread-safe ----------------------------------------------------------------------------

    def new_request_id(self) -> int:
        """A fresh request id (thread-safe). It is live from here on, so a cancel wins even while
        its request is still on its way to `submit`; `forget` it if it is never submitted."""
        with self._lock:
            rid = next(self._ids)
            self._live.add(rid)
            return rid

    def forget(self, request_id: int) -> None:
        """Drop an id that was handed out but will not be submitted (thread-safe)."""
        self._resolved(request_id)

    def abort(self, request_ids: set[int] | list[int]) -> None:
        """Cancel these requests wherever they are: not yet submitted, queued (they leave the
        queue), or running (it stops at its next boundary, or just before commit). Thread-safe;
        unknown or finished ids are ignored."""
        with self._lock:
            self._aborted |= set(request_ids) & self._live

    def is_aborted(self, request_id: int) -> bool:
        """Whether `request_id` was cancelled (thread-safe)."""
        with self._lock:
            return request_id in self._aborted

    # -- streams --------------------------------------------------------------------------------

    def _world(self, model_id: str) -> World:
        if model_id not in self.worlds:
            raise UnknownModelError(f"model {model_id!r} is not loaded; loaded: {sorted(self.worlds)}")
        return self.worlds[model_id]

    def _stream(self, stream_id: str) -> Stream:
        stream = self.runner.streams.get(stream_id)
        if stream is None:
            raise StreamNotFound(stream_id)
        return stream

    def _reserve(self, stream_id: str, model_id: str) -> None:
        self.memory.admit(stream_id, model_id)  # CapacityError: the bytes do not fit
        self._observe_memory()

    def _observe_memory(self) -> None:
        metrics.STREAMS.set(len(self.memory))
        metrics.KV_BYTES.set(self.memory.used_bytes)

    def add_stream(
        self, stream_id: str, model_id: str, cond: Conditioning, debug: DebugHooks | None = None
    ) -> StreamInfo:
        """Create a world for a new stream (admitted by bytes; takes a row of the world's pool).
        Its conditioning is computed here, on the calling thread (`open_stream`: off it)."""
        self._world(model_id)
        self._check_new(stream_id)
        self._reserve(stream_id, model_id)
        return self._install_add(stream_id, model_id, cond, debug or DebugHooks(), None)

    def _check_new(self, stream_id: str) -> None:
        if stream_id in self.runner.streams or stream_id in self._preparing:
            raise ValueError(f"stream {stream_id} exists")

    def _install_add(
        self,
        stream_id: str,
        model_id: str,
        cond: Conditioning,
        debug: DebugHooks,
        prepared: PreparedConditioning | None,
    ) -> StreamInfo:
        """The admitted stream's world (its lease is released if it cannot be built)."""
        try:
            frame = self.runner.add(stream_id, model_id, cond, debug, prepared)
        except Exception:
            self._release(stream_id)
            raise
        self.memory.bind(stream_id, self.runner.streams[stream_id].state)
        return replace(self.info(stream_id), frame=frame)

    def _offloads(self, model_id: str) -> bool:
        return self.conditioning is not None and self.worlds[model_id].heavy_conditioning

    def open_stream(
        self,
        stream_id: str,
        model_id: str,
        cond: Conditioning,
        debug: DebugHooks | None,
        reply: Reply,
    ) -> None:
        """`add_stream` without holding the engine: a world with heavy conditioning is admitted
        now (its bytes held), computes it on the conditioning worker, and is installed by a later
        `step`; `reply` gets the stream's info or the error then (at once for any other world, or
        when the open is refused: `CapacityError` when its bytes do not fit or the worker is
        full). A `remove_stream` before then drops it (`reply`: StreamNotFound)."""
        answer: StreamInfo | Exception
        try:
            self._world(model_id)
            if not self._offloads(model_id):
                answer = self.add_stream(stream_id, model_id, cond, debug)
            else:
                self._check_new(stream_id)
                self._reserve(stream_id, model_id)
                try:
                    job = self._submit_conditioning(stream_id, model_id, cond)
                except Exception:
                    self._release(stream_id)
                    raise
                hooks = debug or DebugHooks()
                self._preparing[stream_id] = _Preparing("add", model_id, cond, hooks, reply, job)
                return
        except Exception as exc:
            answer = exc
        reply(answer)

    def _submit_conditioning(self, stream_id: str, model_id: str, cond: Conditioning) -> ConditioningJob:
        assert self.conditioning is not None
        return self.conditioning.submit(stream_id, self.worlds[model_id], cond)

    def preparing(self, stream_id: str) -> bool:
        """Whether the stream's open or reset is waiting for its conditioning."""
        return stream_id in self._preparing

    def _install_prepared(self) -> None:
        """Install the conditioning the worker finished (a boundary: no batch is running) and
        answer each open or reset."""
        if self.conditioning is None:
            return
        for job in self.conditioning.take_done():
            p = self._preparing.get(job.stream_id)
            if p is None or p.job is not job:
                continue  # dropped (its stream was removed)
            del self._preparing[job.stream_id]
            answer: StreamInfo | Exception
            if job.prepared is None:  # its conditioning failed: the open fails, a reset keeps the old world
                assert job.error is not None
                if p.kind == "add":
                    self._release(job.stream_id)
                answer = job.error
            else:
                self._mark_used(job.prepared)
                try:
                    if p.kind == "add":  # releases the lease if it fails
                        answer = self._install_add(job.stream_id, p.model_id, p.cond, p.debug, job.prepared)
                    else:
                        answer = self._install_reset(job.stream_id, p.cond, job.prepared)
                except Exception as exc:
                    answer = exc
            p.reply(answer)

    def _mark_used(self, prepared: PreparedConditioning) -> None:
        """Made on the worker's CUDA stream: tell the allocator the engine's stream reads them
        too, so their memory is not handed to the worker's next job before these reads ran."""
        for t in prepared.tensors():
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))

    def fork_stream(self, src_id: str, dst_id: str) -> StreamInfo:
        """A new stream holding a copy of `src_id`'s committed world."""
        src = self._stream(src_id)
        self._check_new(dst_id)
        if src_id in self._preparing:
            raise CapacityError(f"stream {src_id} is being reset; fork it after the reset")
        self._settle()
        self._reserve(dst_id, src.model_id)
        try:
            dst = self.runner.fork(src_id, dst_id)
        except Exception:
            self._release(dst_id)
            raise
        self.memory.bind(dst_id, dst.state)
        return self.info(dst_id)

    def reset_stream(self, stream_id: str, cond: Conditioning) -> StreamInfo:
        """A fresh world in the same stream; queued chunks are cancelled (outcomes in the next step).
        If the new world cannot be built, the old one stays and the error is raised. Its
        conditioning is computed here, on the calling thread (`begin_reset`: off it)."""
        self._stream(stream_id)
        if stream_id in self._preparing:
            raise CapacityError(f"stream {stream_id} is being reset already")
        return self._install_reset(stream_id, cond, None)

    def _drop_queued(self, stream_id: str) -> None:
        self._side_outcomes += self._drop({r.request_id for r in self.scheduler.pending(stream_id)})

    def _install_reset(
        self, stream_id: str, cond: Conditioning, prepared: PreparedConditioning | None
    ) -> StreamInfo:
        self._settle()
        self._drop_queued(stream_id)  # (again, for a deferred reset: chunks requeued since its start)
        frame = self.runner.reset(stream_id, cond, prepared)  # the new state takes the pool's spare row
        self.memory.bind(stream_id, self.runner.streams[stream_id].state)
        return replace(self.info(stream_id), frame=frame)

    def rewind_stream(self, stream_id: str, chunk: int) -> StreamInfo:
        """Roll the stream's committed world back to the end of its chunk `chunk` (a transaction
        of its own, between steps): the decode in flight and owed clean passes finish first
        (their chunks commit, outcomes in the next step), then, if `chunk` is retained, the
        stream's queued chunks are cancelled (outcomes in the next step) and the world is set
        back (`Runner.rewind`); `info.frame` is that chunk's last frame. `NotRetained` when it
        is not: nothing is cancelled and the world is as it was."""
        self._stream(stream_id)
        self._settle()
        self.runner.checkpoint(stream_id, chunk)  # NotRetained: nothing changed
        # Numbered in the timeline they were queued in, as a reset's cancel numbers them.
        self._side_outcomes += self._drop({r.request_id for r in self.scheduler.pending(stream_id)})
        frame = self.runner.rewind(stream_id, chunk)
        return replace(self.info(stream_id), frame=frame)

    def begin_reset(self, stream_id: str, cond: Conditioning, reply: Reply) -> None:
        """`reset_stream` without holding the engine: queued chunks are cancelled now; a world
        with heavy conditioning computes it on the conditioning worker and the new world is
        installed by a later `step`, which `reply` waits for (any other world: at once). Until
        then the stream keeps its old world and takes no new chunk (`CapacityError`); `reply`
        gets the info or the error (the old world stays then)."""
        answer: StreamInfo | Exception
        try:
            stream = self._stream(stream_id)
            if stream_id in self._preparing:
                raise CapacityError(f"stream {stream_id} is being reset already")
            if not self._offloads(stream.model_id):
                answer = self.reset_stream(stream_id, cond)
            else:
                job = self._submit_conditioning(stream_id, stream.model_id, cond)
                self._drop_queued(stream_id)
                p = _Preparing("reset", stream.model_id, cond, stream.debug, reply, job)
                self._preparing[stream_id] = p
                return
        except Exception as exc:
            answer = exc
        reply(answer)

    def remove_stream(self, stream_id: str) -> None:
        """End a stream: queued chunks are cancelled (outcomes in the next step) and its device
        state is freed before its budget is (runs between steps, so no batch holds it). An open
        or reset still computing its conditioning is dropped and answered StreamNotFound."""
        p = self._preparing.pop(stream_id, None)
        if p is not None:
            assert self.conditioning is not None
            self.conditioning.cancel(p.job)
            p.reply(StreamNotFound(f"stream {stream_id} was removed while its conditioning was computed"))
            if p.kind == "add":
                self._release(stream_id)
                return
        self._stream(stream_id)
        self._settle()
        numbers = self._queued_chunk_numbers(stream_id)
        dropped = self.scheduler.finish_stream(stream_id)
        self.runner.remove(stream_id)
        self._side_outcomes += [self._cancelled(r, numbers[r.request_id]) for r in dropped]
        self._release(stream_id)

    def capture_stream(self, stream_id: str, session: dict, arrays: dict[str, np.ndarray]) -> Snapshot:
        """The stream's committed world as a `Snapshot` on the host (runtime/snapshot.py), with
        the sessions layer's `session` JSON and `arrays`; the stream runs on. Chunks still in
        flight are finished first (`_settle`): the snapshot holds what committed."""
        stream = self._stream(stream_id)
        self._settle()
        if stream.lost is not None:
            raise InvalidRequest("stream", stream.lost)
        try:
            model_id, weights, tensors, meta = self.memory.capture(stream_id)
        except NotImplementedError as exc:  # a plug-in that cannot write its state
            raise InvalidRequest("type", str(exc)) from exc
        return Snapshot(model_id, weights, meta, tensors, list(stream.action_log), session, arrays)

    def snapshot_stream(self, stream_id: str, session: dict, arrays: dict[str, np.ndarray]) -> bytes:
        """`capture_stream` as snapshot bytes (`runtime.snapshot.encode`)."""
        return encode(self.capture_stream(stream_id, session, arrays))

    def restore_stream(
        self, stream_id: str, data: bytes | Snapshot
    ) -> tuple[StreamInfo, dict, dict[str, np.ndarray]]:
        """A new stream holding the world of snapshot bytes (or of a decoded `Snapshot`); returns
        its info and the sessions layer's JSON and arrays. `SnapshotError` (nothing changes) for
        damaged bytes, another format, a model not loaded, other weights or tensors that do not
        fit; `CapacityError` when its bytes do not fit the budget."""
        if stream_id in self.runner.streams:
            raise ValueError(f"stream {stream_id} exists")
        snap = decode(data) if isinstance(data, bytes) else data
        check_world(snap, self.worlds)
        self._settle()
        try:
            lease = self.memory.install(stream_id, snap.model_id, snap.tensors, snap.world)
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise SnapshotError("unfit", f"snapshot does not fit model {snap.model_id}: {exc}") from exc
        finally:
            self._observe_memory()
        assert lease.state is not None
        stream = Stream(stream_id, snap.model_id, lease.state)
        stream.action_log.extend(snap.action_log)
        self.runner.streams[stream_id] = stream
        return self.info(stream_id), snap.session, snap.arrays

    def close(self, timeout: float = 10.0) -> bool:
        """Free every stream's device state (the engine is done: nothing runs after this) and
        stop the conditioning worker (opens and resets still waiting for it are answered
        EngineDeadError). Explicit, so a world an engine leaves behind has every row free for the
        next. False when the worker is still inside a model call after `timeout` s."""
        stopped = True
        if self.conditioning is not None:
            stopped = self.conditioning.close(timeout)
        for stream_id, p in list(self._preparing.items()):
            del self._preparing[stream_id]
            if p.kind == "add":
                self._release(stream_id)
            p.reply(EngineDeadError("engine closed"))
        for stream_id in list(self.runner.streams):
            self.runner.remove(stream_id)
            self._release(stream_id)
        return stopped

    def _settle(self) -> None:
        """Finish a decode still in flight and run the owed clean passes, so control calls see
        a committed world (outcomes go out with the next step)."""
        if self.runner.busy:
            self._side_outcomes += self._finish(self.runner.execute(StepPlan.make_empty()))
            self._side_outcomes += self._finish(self.runner.decode())

    def _release(self, stream_id: str) -> None:
        self.memory.release(stream_id)
        self._observe_memory()

    def info(self, stream_id: str) -> StreamInfo:
        """The stream's committed position."""
        s = self._stream(stream_id)
        st = s.state
        kv = self.worlds[s.model_id].kv_bytes_per_session()
        charged = self.memory.lease(stream_id).nbytes
        return StreamInfo(stream_id, s.model_id, st.chunks, st.frames, st.video_frames, kv, charged)

    def action_log(self, stream_id: str) -> tuple[int, list[list[FrameAction]]]:
        """The stream's committed chunk count and its action log (the per-frame actions of its
        newest committed chunks, oldest first; `ACTION_LOG_CHUNKS` at most), a copy."""
        s = self._stream(stream_id)
        return s.state.chunks, list(self.runner.streams[stream_id].action_log)

    def world_of(self, stream_id: str) -> World:
        """The world a stream runs on."""
        return self.worlds[self._stream(stream_id).model_id]

    def _shape_of(self, stream_id: str) -> ChunkShape:
        stream = self.runner.streams[stream_id]
        return ChunkShape(stream.model_id, self.worlds[stream.model_id].chunk_frames)

    def next_chunk_video_frames(self, stream_id: str) -> int:
        """Video frames of the stream's next chunk once everything queued before it has committed."""
        stream = self._stream(stream_id)
        world = self.worlds[stream.model_id]
        ahead = self.scheduler.queued(stream_id) + self.runner.in_flight(stream_id)
        latent = stream.state.frames + ahead * world.chunk_frames
        return world.layout.video_frames(latent, world.chunk_frames)

    # -- chunks ---------------------------------------------------------------------------------

    def submit(self, request: ChunkRequest) -> None:
        """Queue a chunk request (validated against the stream's world). A request cancelled
        before it got here is answered `ChunkCancelled` by the next step. On error the id is
        resolved and the error raised."""
        rid = request.request_id
        try:
            stream = self._stream(request.stream_id)
            if request.stream_id in self._preparing:
                raise CapacityError(f"stream {request.stream_id} is being reset; submit after the reset")
            if self.scheduler.queued(request.stream_id) >= self.max_queued:
                raise CapacityError(f"stream {request.stream_id} already has {self.max_queued} chunks queued")
            if request.actions is not None:
                self._check_actions(stream, request.actions, self.next_chunk_video_frames(request.stream_id))
        except Exception:
            self._resolved(rid)
            raise
        with self._lock:
            if rid not in self._live:
                raise ValueError(f"request id {rid} was not handed out by new_request_id() or is finished")
            aborted = rid in self._aborted
        if aborted:
            sid = request.stream_id
            chunk = stream.state.chunks + 1 + self.runner.in_flight(sid) + self.scheduler.queued(sid)
            self._side_outcomes.append(self._cancelled(request, chunk))
            return
        request.submitted_at = request.submitted_at or time.perf_counter()
        self.scheduler.add_request(request)

    def _check_actions(self, stream: Stream, actions: list[FrameAction] | tuple, expected: int) -> None:
        space = self.worlds[stream.model_id].action_space
        if len(actions) not in (0, 1, expected):
            raise InvalidRequest(
                "actions", f"this chunk takes 1 or {expected} frame actions, got {len(actions)}"
            )
        for a in actions:
            problem = space.problem(a)
            if problem is not None:
                raise InvalidRequest(*problem)

    def has_work(self) -> bool:
        """Whether `step()` would do anything."""
        ready = self.conditioning is not None and self.conditioning.has_done()
        return self.scheduler.has_unfinished() or bool(self._side_outcomes) or self.runner.busy or ready

    def step(self) -> list[Outcome]:
        """Schedule one batch, run it, commit what survived; return every outcome produced.
        Pipelined, a batch's chunks commit in the step after the one that computed them."""
        start = time.perf_counter()
        if self._timing is not None:
            self._timing.charge_gap(start)
        self._install_prepared()  # before the outcomes are taken: a reset's drops go out now
        outcomes, self._side_outcomes = self._side_outcomes, []
        outcomes += self._process_aborts()
        plan = self.scheduler.schedule()
        self._observe_queue(plan)
        if plan.is_empty and not self.runner.busy:
            return outcomes
        outcomes += self._finish(self.runner.execute(plan))
        outcomes += self._process_aborts()  # requests cancelled while the batch ran
        out = self.runner.decode()
        outcomes += self._finish(out)
        self.scheduler.update_from_output(plan)
        for sc in out.requeue:  # ran on top of a chunk that did not commit: runs again next
            self.scheduler.requeue(sc.request)
        if plan.chunks:
            metrics.BATCH_SIZE.observe(len(plan.chunks))
        self._time_batch(plan, start)
        return outcomes

    def _observe_queue(self, plan: StepPlan) -> None:
        for sc in plan.chunks:
            if sc.waited_s is not None:
                mode = "realtime" if sc.request.source is not None else "lockstep"
                metrics.QUEUE_WAIT.labels(plan.model_id, mode).observe(sc.waited_s)
        metrics.QUEUED.set(self.scheduler.waiting())

    def _time_batch(self, plan: StepPlan, start: float) -> None:
        """Charge a step's time to the batch it ran, or, for a step that only finished the last
        batch (its owed clean pass, its pipelined decode), to that batch; a batch's sample goes
        to the meter when the next batch starts."""
        end = time.perf_counter()
        if plan.chunks:
            if self._timing is not None:
                done = self._timing
                rate = self.throughput.record(done.model_id, done.batch, done.seconds)
                if rate is not None:
                    metrics.CHUNK_RATE.labels(done.model_id).set(rate)
            self._timing = BatchTimer(plan.model_id, len(plan.chunks))
        if self._timing is not None:
            self._timing.seconds += end - start
            # With work left the thread steps again at once: the time until then (outcomes
            # handed out, requests taken in) is engine time too. Idle time is not.
            self._timing.gap_from = end if self.has_work() else None

    def _process_aborts(self) -> list[Outcome]:
        with self._lock:
            ids = set(self._aborted)
        return self._drop(ids) if ids else []

    def _queued_chunk_numbers(self, stream_id: str) -> dict[int, int]:
        """Request id -> the chunk number it would commit as, for the stream's queue in order."""
        base = self.runner.streams[stream_id].state.chunks + 1 + self.runner.in_flight(stream_id)
        return {r.request_id: base + i for i, r in enumerate(self.scheduler.pending(stream_id))}

    def _drop(self, request_ids: set[int]) -> list[Outcome]:
        """Take these requests out of the queue (not a running one); one `ChunkCancelled` each."""
        numbers: dict[int, int] = {}
        for sid in self.runner.streams:
            numbers |= self._queued_chunk_numbers(sid)
        return [self._cancelled(r, numbers[r.request_id]) for r in self.scheduler.abort_requests(request_ids)]

    def _finish(self, out: RunnerOutput) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for txn in out.staged:
            if self.is_aborted(txn.request.request_id):
                txn.rollback()
                out.cancelled.append(txn)
                continue
            done: ChunkCommitted = txn.commit()
            for stage, ms in done.timings.as_dict().items():
                metrics.CHUNK_STAGE_MS.labels(stage).observe(ms)
            metrics.CHUNKS.labels(txn.stream.model_id, "committed").inc()
            outcomes.append(done)
            self._resolved(done.request_id)
        for txn in out.cancelled:
            metrics.CHUNKS.labels(txn.stream.model_id, "cancelled").inc()
            outcomes.append(
                ChunkCancelled(txn.request.request_id, txn.stream.stream_id, txn.chunk, started=True)
            )
            self._resolved(txn.request.request_id)
        for txn, message in out.failed:
            metrics.CHUNKS.labels(txn.stream.model_id, "failed").inc()
            outcomes.append(ChunkFailed(txn.request.request_id, txn.stream.stream_id, txn.chunk, message))
            self._resolved(txn.request.request_id)
        return outcomes

    def _cancelled(self, request: ChunkRequest, chunk: int) -> ChunkCancelled:
        self._resolved(request.request_id)
        return ChunkCancelled(request.request_id, request.stream_id, chunk, started=False)

    def _resolved(self, request_id: int) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._aborted.discard(request_id)


class EngineThread:
    """Runs an `Engine` on a dedicated thread; asyncio callers get futures."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        max_inputs: int = 4096,
        threads: int | None = None,
        prompt_threads: int = 1,
    ) -> None:
        """`threads`: torch intra-op threads of the engine thread, set on that thread when it
        starts (None: the process's setting). Why on it: OpenMP gives every thread that runs a
        parallel op its own worker team, and while a second team exists on a machine with no spare
        core libgomp stops its workers spinning between ops, so each of a chunk's thousands of
        small ops waits for a wake-up (tiny-world, 2 threads on 2 cores: 113-123 ms a chunk with
        the engine's team alone, 166-262 ms with the main thread's team alive beside it). The
        process's other threads should stay on one thread (`torch.set_num_threads(1)` before
        loading), as `worldserve serve` does. `prompt_threads`: the prompt worker's torch threads
        (`prepare_prompt`)."""
        if threads is not None and threads < 1:
            raise ValueError(f"engine threads must be at least 1, not {threads}")
        self.threads = threads
        self.engine = engine
        self.loop = loop
        self._inputs: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=max_inputs)
        self._futures: dict[int, tuple[str, asyncio.Future]] = {}  # request id -> (stream, future)
        self._calls: set[asyncio.Future] = set()  # control calls not yet run
        self._flock = threading.Lock()
        self._running = False
        self._stop_requested = False
        self._dead: BaseException | None = None
        # A daemon, so a model call that never ends cannot hold the process; `_guard_exit` makes
        # sure the interpreter never finalizes while it is inside one.
        self._thread = threading.Thread(target=self._run, name="worldserve-engine", daemon=True)
        self._prompts = PromptWorker(threads=prompt_threads)  # text encodes, off this thread and the loop
        engine.wake = self._wake  # a finished conditioning wakes the thread from its idle wait

    @property
    def dead(self) -> bool:
        """True once the engine thread has died."""
        return self._dead is not None

    @property
    def alive(self) -> bool:
        """True while the worker thread runs (after `stop`: still inside a model call)."""
        return self._thread.is_alive()

    def start(self) -> None:
        """Start the worker thread."""
        self._running = True
        self._thread.start()
        _STARTED.add(self)

    def stop(self, timeout: float = 10.0) -> bool:
        """Abort every outstanding chunk (a running one stops at its next denoising boundary),
        let the thread finish its step and join it for up to `timeout` s; pending futures fail
        with EngineDeadError. False when the thread is still running after that (inside one model
        call longer than `timeout`); the process then leaves without waiting for it at exit
        (`_guard_exit`)."""
        self._stop_requested = True
        self._running = False
        self._prompts.stop(timeout)
        with self._flock:
            ids = list(self._futures)
        self.engine.abort(ids)
        self._wake()
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("engine stopped"))
        if self._thread.is_alive():
            log.warning("= engine thread still inside a model call %.1f s after stop", timeout)
            return False
        worker = self.engine.conditioning
        if worker is not None and not worker.close(timeout):
            log.warning("= conditioning worker still inside a model call %.1f s after stop", timeout)
            return False
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """`stop`, then, once the thread has ended, free every stream's device state
        (`Engine.close`), so the worlds have every row free for whoever uses them next. False
        as `stop` (the thread is still inside a model call: its rows stay held)."""
        stopped = self.stop(timeout)
        if stopped:
            self.engine.close()
        return stopped

    def _guard_exit(self) -> None:
        """At interpreter exit. A daemon thread still inside torch when the interpreter
        finalizes kills the process ("terminate called without an active exception", SIGABRT),
        so stop the thread first (bounded: EXIT_GRACE_S if nobody stopped it yet) and, if it is
        still inside a model call, leave at once: status 0 after a requested stop (the process's
        work is done; the chunk it cuts was aborted), 1 when nobody stopped the engine. The same
        for the conditioning worker's thread."""
        worker = self.engine.conditioning
        if not self._thread.is_alive() and (worker is None or not worker.alive):
            return
        requested = self._stop_requested
        if self.stop(0.0 if requested else EXIT_GRACE_S):
            return
        status = 0 if requested else 1
        log.warning(
            "= engine thread or conditioning worker still inside a model call at exit; leaving "
            "now without waiting for it (exit status %d)",
            status,
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    def _put(self, fn: Callable[[], None]) -> None:
        try:
            self._inputs.put_nowait(fn)
        except queue.Full as exc:
            raise CapacityError("engine input queue is full") from exc

    def _wake(self) -> None:
        """Make an idle engine thread look for work now (thread-safe)."""
        with contextlib.suppress(CapacityError):  # a full queue wakes the thread as well
            self._put(lambda: None)

    # -- asyncio side ---------------------------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run `fn(*args)` on the engine thread between steps; the future holds its result."""

        def answer(*args_and_reply: Any) -> None:
            *given, reply = args_and_reply
            reply(fn(*given))

        return self.call_deferred(answer, *args)

    def call_deferred(self, fn: Callable[..., None], *args: Any) -> asyncio.Future[Any]:
        """Run `fn(*args, reply)` on the engine thread between steps; the future holds what
        `reply` is given (an exception: raised), now or at a later step (`Engine.open_stream`)."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        fut: asyncio.Future[Any] = self.loop.create_future()
        with self._flock:
            self._calls.add(fut)

        def reply(answer: Any) -> None:
            with self._flock:
                self._calls.discard(fut)
            if self.loop.is_closed():
                return
            if isinstance(answer, BaseException):
                self.loop.call_soon_threadsafe(_set_exception, fut, answer)
            else:
                self.loop.call_soon_threadsafe(_set_result, fut, answer)

        def job() -> None:
            try:
                fn(*args, reply)
            except Exception as exc:  # handed to the caller, the engine goes on
                reply(exc)

        try:
            self._put(job)
        except CapacityError:
            with self._flock:
                self._calls.discard(fut)
            raise
        return fut

    # -- the engine's interface for sessions ----------------------------------------------------

    def new_request_id(self) -> int:
        """A fresh chunk request id (thread-safe; see `Engine.new_request_id`)."""
        return self.engine.new_request_id()

    @property
    def retention(self) -> int:
        """Chunks a stream can be rewound by (fixed for the engine's life: read anywhere)."""
        return self.engine.retention

    def specs(self) -> dict[str, ModelSpec]:
        """The loaded worlds' specs by model id (fixed for the engine's life: read anywhere)."""
        return {name: world.spec for name, world in self.engine.worlds.items()}

    def prompt_problem(self, model_id: str, prompt: str) -> str | None:
        """Why `model_id` cannot take `prompt` (None: it can); reads no tensor."""
        return self.engine.worlds[model_id].prompt_problem(prompt)

    def prepare_prompt(self, model_id: str, prompt: str) -> asyncio.Future[None]:
        """Encode `prompt` for `model_id` into its text encoder's cache on the prompt worker, so
        the stream's `init_state` finds it there; done at once for worlds whose prompts need no
        encode (precomputed files). The future raises ConditioningError (field `prompt`) for a
        prompt the encoder refuses, CapacityError when too many encodes wait."""
        source = self.engine.worlds[model_id].prompts
        prepare = getattr(source, "prepare", None)
        if prepare is None:
            done: asyncio.Future[None] = self.loop.create_future()
            done.set_result(None)
            return done
        cache = getattr(source, "cache", None)

        def job() -> None:
            start = time.perf_counter()
            try:
                hit = prepare(prompt)
            except ValueError as exc:
                raise ConditioningError("prompt", str(exc)) from exc
            metrics.PROMPT_CACHE.labels("hit" if hit else "miss").inc()
            if not hit:
                metrics.PROMPT_ENCODE_MS.observe((time.perf_counter() - start) * 1e3)
            if cache is not None:
                metrics.PROMPT_CACHE_BYTES.set(cache.stats().nbytes)

        return asyncio.wrap_future(self._prompts.submit(job), loop=self.loop)

    def rate(self, model_id: str) -> float | None:
        """The measured chunks/s of `model_id`'s batches (None until measured)."""
        return self.engine.throughput.rate(model_id)

    def add_stream(
        self, stream_id: str, model_id: str, cond: Conditioning, debug: DebugHooks | None = None
    ) -> asyncio.Future[StreamInfo]:
        """`Engine.open_stream` on the engine thread (admitted by bytes: CapacityError when full);
        the future resolves once the world is installed (heavy conditioning is computed off the
        engine thread meanwhile)."""
        return self.call_deferred(self.engine.open_stream, stream_id, model_id, cond, debug)

    def fork_stream(self, src_id: str, dst_id: str) -> asyncio.Future[StreamInfo]:
        """`Engine.fork_stream` on the engine thread: one call copies a stream's committed world."""
        return self.call(self.engine.fork_stream, src_id, dst_id)

    def reset_stream(self, stream_id: str, cond: Conditioning) -> asyncio.Future[StreamInfo]:
        """`Engine.begin_reset` on the engine thread; resolves once the new world is installed."""
        return self.call_deferred(self.engine.begin_reset, stream_id, cond)

    def rewind_stream(self, stream_id: str, chunk: int) -> asyncio.Future[StreamInfo]:
        """`Engine.rewind_stream` on the engine thread (`NotRetained` when out of retention)."""
        return self.call(self.engine.rewind_stream, stream_id, chunk)

    def remove_stream(self, stream_id: str) -> asyncio.Future[None]:
        """`Engine.remove_stream` on the engine thread (frees the stream's device state)."""
        return self.call(self.engine.remove_stream, stream_id)

    def snapshot_stream(
        self, stream_id: str, session: dict, arrays: dict[str, np.ndarray]
    ) -> asyncio.Future[bytes]:
        """`Engine.capture_stream` on the engine thread, then its encoding (a checksum over every
        byte) in the loop's default executor, not on the engine thread."""
        captured = self.call(self.engine.capture_stream, stream_id, session, arrays)

        async def encoded() -> bytes:
            return await self.loop.run_in_executor(None, encode, await captured)

        return asyncio.ensure_future(encoded())

    def restore_stream(
        self, stream_id: str, data: bytes
    ) -> asyncio.Future[tuple[StreamInfo, dict, dict[str, np.ndarray]]]:
        """The bytes decoded and checked in the loop's default executor, then
        `Engine.restore_stream` on the engine thread (`SnapshotError`, `CapacityError`)."""

        async def restored() -> tuple[StreamInfo, dict, dict[str, np.ndarray]]:
            snap = await self.loop.run_in_executor(None, decode, data)
            return await self.call(self.engine.restore_stream, stream_id, snap)

        return asyncio.ensure_future(restored())

    def used_bytes(self) -> int:
        """Device bytes the budget charges live streams now (read from any thread: a sum over
        a dict the engine thread changes, so a figure for /metrics, not for decisions)."""
        return self.engine.memory.used_bytes

    def free_bytes(self) -> int:
        """Device bytes of the budget no session takes now (a figure, as `used_bytes`): what a
        cluster front end places new sessions by."""
        return self.engine.memory.free_bytes

    def session_cost(self, model_id: str) -> int:
        """Device bytes one more session of `model_id` is charged."""
        return self.engine.memory.costs[model_id].session

    def info(self, stream_id: str) -> asyncio.Future[StreamInfo]:
        """`Engine.info` on the engine thread."""
        return self.call(self.engine.info, stream_id)

    def action_log(self, stream_id: str) -> asyncio.Future[tuple[int, list[list[FrameAction]]]]:
        """`Engine.action_log` on the engine thread."""
        return self.call(self.engine.action_log, stream_id)

    def submit(self, request: ChunkRequest) -> asyncio.Future[Outcome]:
        """Queue a chunk; the future resolves with its outcome (or raises the submit error)."""
        if self._dead is not None:
            self.engine.forget(request.request_id)
            raise EngineDeadError(str(self._dead))
        fut: asyncio.Future[Outcome] = self.loop.create_future()
        with self._flock:
            self._futures[request.request_id] = (request.stream_id, fut)

        def job() -> None:
            try:
                self.engine.submit(request)
            except Exception as exc:
                with self._flock:
                    self._futures.pop(request.request_id, None)
                self.loop.call_soon_threadsafe(_set_exception, fut, exc)

        try:
            self._put(job)
        except CapacityError:
            with self._flock:
                self._futures.pop(request.request_id, None)
            self.engine.forget(request.request_id)
            raise
        return fut

    def cancel_stream(self, stream_id: str) -> int:
        """Abort every outstanding chunk of a stream (thread-safe, immediate); returns how many."""
        with self._flock:
            ids = [rid for rid, (sid, _) in self._futures.items() if sid == stream_id]
        self.engine.abort(ids)
        return len(ids)

    def outstanding(self, stream_id: str) -> int:
        """Chunks of a stream submitted and not yet resolved."""
        with self._flock:
            return sum(1 for sid, _ in self._futures.values() if sid == stream_id)

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while self._running:
            try:
                block = not self.engine.has_work()
                self._drain(block)
                outcomes = self.engine.step()
            except BaseException as exc:
                log.exception("engine thread died")
                self._dead = exc
                self._fail_all(EngineDeadError(f"engine died: {exc}"))
                return
            self._deliver(outcomes)

    def _drain(self, block: bool) -> None:
        try:
            fn = self._inputs.get(timeout=0.5) if block else self._inputs.get_nowait()
        except queue.Empty:
            return
        fn()
        while True:
            try:
                fn = self._inputs.get_nowait()
            except queue.Empty:
                return
            fn()

    def _deliver(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            with self._flock:
                entry = self._futures.pop(o.request_id, None)
            if entry is not None:
                self.loop.call_soon_threadsafe(_set_result, entry[1], o)

    def _fail_all(self, exc: Exception) -> None:
        with self._flock:
            futs = [f for _, f in self._futures.values()] + list(self._calls)
            self._futures.clear()
            self._calls.clear()
        for fut in futs:
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(_set_exception, fut, exc)


_STARTED: weakref.WeakSet[EngineThread] = weakref.WeakSet()  # a running thread keeps its own alive


@atexit.register  # registered after logging's, so it runs before logging shuts down
def _guard_engine_threads() -> None:
    for et in list(_STARTED):
        et._guard_exit()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
