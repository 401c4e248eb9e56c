"""A cluster (Ray replicas behind a front end) running on its own event loop in a thread, for
tests whose clients run on theirs. Imports Ray: only cluster tests import this module."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from web.cluster.control import Cluster, ReplicaSpec
from web.cluster.frontend import FrontEnd
from web.hub import ServerConfig

SECRET = b"k" * 32


class Running:
    """``count`` replicas of ``spec`` behind a front end with ``front_config``, checkpointing
    every ``checkpoint_s`` seconds; started on ``with``, stopped after it."""

    def __init__(
        self, count: int, spec: ReplicaSpec, front_config: ServerConfig, checkpoint_s: float = 0.2
    ) -> None:
        self.count = count
        self.spec = spec
        self.front_config = front_config
        self.checkpoint_s = checkpoint_s
        self.loop = asyncio.new_event_loop()
        self.front: FrontEnd | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._main(),), daemon=True
        )

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        cluster = await Cluster.start(self.count, self.spec, SECRET)
        cluster.start_checkpoints(self.checkpoint_s)
        self.front = FrontEnd(cluster, self.front_config)
        await self.front.start()
        self._started.set()
        await self._stop.wait()
        await self.front.stop()
        await cluster.stop()

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the cluster's loop (the control's tasks live there) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def __enter__(self) -> Running:
        self._thread.start()
        assert self._started.wait(300), "cluster did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)
