"""The prompt worker: jobs run in order on its own thread, bounded, errors handed back."""

from __future__ import annotations

import threading

import pytest

from runtime.errors import CapacityError
from runtime.prompt_worker import PromptWorker


def test_jobs_run_on_the_worker_thread_and_errors_come_back() -> None:
    worker = PromptWorker(max_pending=4)
    try:
        assert worker.submit(lambda: threading.current_thread().name).result(10) == "worldserve-prompts"

        def bad() -> None:
            raise ValueError("no")

        with pytest.raises(ValueError, match="no"):
            worker.submit(bad).result(10)
        assert worker.submit(lambda: 7).result(10) == 7  # the worker goes on
    finally:
        worker.stop()


def test_pending_jobs_are_bounded() -> None:
    worker = PromptWorker(max_pending=2)
    release = threading.Event()
    started = threading.Event()

    def block() -> int:
        started.set()
        release.wait(10)
        return 1

    try:
        running = worker.submit(block)
        assert started.wait(10)
        queued = [worker.submit(lambda: 2), worker.submit(lambda: 3)]  # the queue's two places
        with pytest.raises(CapacityError, match="retry later"):
            worker.submit(lambda: 4)
        release.set()
        assert [running.result(10), *(f.result(10) for f in queued)] == [1, 2, 3]
    finally:
        release.set()
        worker.stop()
