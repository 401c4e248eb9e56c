"""A session's conditioning, computed off the engine thread.

Opening or resetting a session of a world with heavy conditioning (`World.heavy_conditioning`:
an image encoder, a vision tower) runs `World.prepare` here, on one worker thread, while the
engine thread goes on stepping every other session's chunks; the engine installs the result
(`World.init_state` with it: a pool row, copies) between two steps, and only then answers the
open or reset. Without this, every other session's chunk waited for the whole encode.

Bounds and policies:

* at most `max_jobs` jobs at once, queued, running or done and not yet installed (a done one
  holds one session's prepared tensors until the engine's next step takes them); one more is
  refused with `CapacityError` (the sessions answer `busy`);
* one job runs at a time, first in first out (so one `prepare` at a time: a VAE encoder keeps
  scratch on its module);
* a cancelled job (its session closed) leaves the queue at once; a running one cannot be
  interrupted inside a model call: it finishes, its result is dropped, and its slot counts until
  then;
* an error in a job is that job's (its session's open or reset fails), never the worker's.

Threads: the worker runs with `threads` torch intra-op threads (default 1), set on its own thread
(the setting is per thread), at a lower CPU priority (`nice`, default 5, Linux): on a CPU the
worker competes with the engine thread for cores, and when they are short the engine's chunks
win them and the open waits longer, instead of every session's chunks slowing down (measured in
benchmarks/mg_cond_stall.py); with a core to spare the priority changes nothing. On CUDA the
work runs on the worker's own CUDA stream, which it waits for before handing the result over,
so the engine's streams never wait on it and the engine reads finished tensors.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.world import Conditioning, PreparedConditioning, World
from runtime.errors import CapacityError

log = logging.getLogger(__name__)
CONDITIONING_NICE = 5  # the worker thread's CPU priority below the engine's (benchmarks/mg_cond_stall.py)


@dataclass(eq=False)
class ConditioningJob:
    """One session's `World.prepare`: queued, running, then done with a result or an error."""

    stream_id: str
    world: World
    cond: Conditioning
    prepared: PreparedConditioning | None = None
    error: Exception | None = None
    cancelled: bool = False


class ConditioningWorker:
    """One thread that runs `World.prepare` jobs; the engine thread takes the finished ones."""

    def __init__(
        self,
        max_jobs: int = 4,
        threads: int = 1,
        wake: Callable[[], None] | None = None,
        nice: int = CONDITIONING_NICE,
    ) -> None:
        """`max_jobs`: jobs queued or running at once; `threads`: the worker's torch intra-op
        threads; `wake`: called (on the worker) when a job is done, so an idle engine thread
        looks at once; `nice`: how much lower the worker thread's CPU priority is than the
        process's (Linux; 0: the same). The thread starts with the first job."""
        if max_jobs < 1 or threads < 1:
            raise ValueError("max_jobs and threads must be at least 1")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in 0..19, not {nice}")
        self.max_jobs = max_jobs
        self.threads = threads
        self.nice = nice
        self.wake = wake or (lambda: None)
        self._cv = threading.Condition()
        self._queue: collections.deque[ConditioningJob] = collections.deque()
        self._running: ConditioningJob | None = None
        self._done: list[ConditioningJob] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    # -- the engine thread's side ---------------------------------------------------------------

    def submit(self, stream_id: str, world: World, cond: Conditioning) -> ConditioningJob:
        """Queue `world.prepare(cond)`; `CapacityError` when `max_jobs` jobs are queued, running
        or waiting to be taken."""
        job = ConditioningJob(stream_id, world, cond)
        with self._cv:
            if self._closed:
                raise CapacityError("the conditioning worker is closed")
            if self.jobs >= self.max_jobs:
                raise CapacityError(
                    f"the server is conditioning {self.max_jobs} new worlds already (opens and "
                    "resets); retry later"
                )
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="worldserve-conditioning", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job

    def cancel(self, job: ConditioningJob) -> None:
        """Drop a job: out of the queue now, or its result dropped when it finishes."""
        with self._cv:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
            if job in self._done:
                self._done.remove(job)

    def take_done(self) -> list[ConditioningJob]:
        """The jobs finished since the last call (not cancelled), oldest first."""
        with self._cv:
            done, self._done = self._done, []
        return done

    def has_done(self) -> bool:
        """Whether a finished job waits to be taken."""
        with self._cv:
            return bool(self._done)

    @property
    def jobs(self) -> int:
        """Jobs queued, running or waiting to be taken (what counts against `max_jobs`)."""
        with self._cv:
            return len(self._queue) + (self._running is not None) + len(self._done)

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (after `close`: still inside a model call)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> bool:
        """Drop every queued job and stop the thread once its job (if any) is done; joins for
        up to `timeout` s. False when it is still inside a model call after that."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.cancelled = True
            self._queue.clear()
            self._done.clear()
            self._cv.notify()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # -- the worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # per thread: the engine thread keeps its own
        if self.nice:
            try:  # Linux: a thread id names the thread alone; raising it needs no privilege
                tid = threading.get_native_id()
                lower = min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice)
                os.setpriority(os.PRIO_PROCESS, tid, lower)
            except (AttributeError, OSError) as exc:
                log.debug("conditioning worker keeps its CPU priority: %s", exc)
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._running = self._queue.popleft()
            try:
                job.prepared = self._prepare(job)
            except Exception as exc:  # the job's session fails its open/reset; the worker goes on
                log.warning("conditioning of %s failed: %s: %s", job.stream_id, type(exc).__name__, exc)
                job.error = exc
            with self._cv:
                self._running = None
                if job.cancelled or self._closed:
                    continue
                self._done.append(job)
            self.wake()

    def _prepare(self, job: ConditioningJob) -> PreparedConditioning:
        device = job.world.device
        if device.type != "cuda":
            return job.world.prepare(job.cond)
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(side):
            prepared = job.world.prepare(job.cond)
        side.synchronize()  # blocks this thread only; the engine then reads finished tensors
        return prepared
