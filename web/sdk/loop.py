"""An asyncio event loop on a daemon thread, so synchronous code can drive async SDK sessions.

The gym environments run every session on one such loop: a vector env's N steps are sent from
the same loop before any reply is awaited, so they reach the server's engine together.
"""

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One event loop running on its own thread until :meth:`close`."""

    def __init__(self, name: str = "worldserve-sdk") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the SDK loop is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()  # a timeout or Ctrl-C here must not leave the coroutine running
            raise

    def close(self) -> None:
        """Stop the loop and join its thread (idempotent)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        if not self.loop.is_closed():
            self.loop.close()
