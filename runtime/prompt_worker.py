"""The prompt worker: one thread that encodes prompts, so neither the event loop nor the engine
thread waits for a text encoder (a UMT5-XXL encode takes seconds on a CPU).

Bounded: at most `max_pending` encodes queued or running; one more is refused with
CapacityError (the client's `busy`). One thread because the encoder is one model: encodes run one
after another, and a cached prompt (the common case) is answered at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

from runtime.errors import CapacityError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PENDING = 16


class PromptWorker:
    """A daemon thread running submitted jobs in order, at most `max_pending` at once."""

    def __init__(self, max_pending: int = MAX_PENDING, threads: int = 1) -> None:
        """`threads`: torch intra-op threads of the worker (one by default: a second OpenMP team
        beside the engine's slows every engine op on a small CPU, see `EngineThread`)."""
        if max_pending < 1 or threads < 1:
            raise ValueError("prompt worker: max_pending and threads must be at least 1")
        self.threads = threads
        self._jobs: queue.Queue[tuple[Callable[[], object], Future] | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the worker; the future holds its result or exception. CapacityError when
        `max_pending` jobs are already waiting."""
        fut: Future[T] = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="worldserve-prompts", daemon=True)
                self._thread.start()
            try:
                self._jobs.put_nowait((fn, fut))
            except queue.Full as exc:
                raise CapacityError("too many prompts waiting to be encoded; retry later") from exc
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        """Let queued jobs finish, then end the thread (waits up to `timeout` s)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller; the worker goes on
                fut.set_exception(exc)
