"""App wiring: worlds loaded by name, and the engine thread + session manager that serve them.

The websocket server and the CLI's in-process ``generate`` both run on a :class:`Runtime`, so a
one-shot from the command line goes through exactly the loop a client's session does.
"""

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from models import registry
from models.world import World
from runtime.engine import Engine, EngineThread
from sessions.manager import SessionManager
from sessions.store import StateStore
from web import startup

__all__ = ["DTYPES", "Runtime", "load_worlds"]

DTYPES = {name: getattr(torch, name) for name in startup.DTYPES}  # --dtype name -> torch dtype


def load_worlds(names: Iterable[str], device: str = "cpu", dtype: str = "float32") -> dict[str, World]:
    """Worlds by their spec id, from registry names or local model directories (never a hub)."""
    worlds: dict[str, World] = {}
    for name in names:
        world = registry.from_name(name, device=device, dtype=DTYPES[dtype])
        worlds[world.spec.id] = world
    return worlds


@dataclass
class Runtime:
    """An engine thread and the session manager on top of it, bound to the running event loop."""

    engine_thread: EngineThread
    manager: SessionManager

    @classmethod
    def start(
        cls,
        worlds: Mapping[str, World],
        *,
        default_model: str | None = None,
        max_batch: int = 4,
        realtime_headroom: float | None = None,
        max_sessions: int = 16,
        device_memory: int | None = None,
        overlap_decode: bool | None = None,
        defer_clean_pass: bool | None = None,
        detach_ttl_s: float = 60.0,
        debug_hooks: bool = False,
        threads: int | None = None,
        prompt_threads: int = 1,
        retention: int = 0,
        deterministic: bool = False,
        host_memory: int | None = None,
        spill_dir: Path | None = None,
        new_token: Callable[[], str] | None = None,
    ) -> "Runtime":
        """Start the engine thread on the running loop; ``default_model`` None = the first world;
        ``overlap_decode`` None = pipelined decode when a world runs on CUDA (runtime/runner.py);
        ``defer_clean_pass`` None = each chunk's clean pass runs after its frames are out unless
        the decode overlaps (runtime/runner.py);
        ``threads``: the engine thread's torch threads (`EngineThread`; None: the process's);
        ``prompt_threads``: the prompt worker's torch threads (text encoders; `EngineThread`);
        ``realtime_headroom``: realtime admission (`SessionManager`; None: off);
        ``retention``: chunks a session can rewind by (runtime/history.py);
        ``deterministic``: frames independent of batch mates (`Engine`);
        ``device_memory``: bytes for every world's sessions together, the budget the engine sizes
        its pools from and admits by (runtime/memory.py; None: room for ``max_sessions``);
        ``host_memory``: bytes of host memory for sessions offloaded from a full device budget,
        past which they go to ``spill_dir`` (`SessionManager`; None: no offload);
        ``new_token``: makes resume tokens (`SessionManager`; None: random)."""
        if not worlds:
            raise ValueError("no worlds to serve")
        default = default_model or next(iter(worlds))
        if default not in worlds:
            raise ValueError(f"default model {default!r} is not loaded; loaded: {sorted(worlds)}")
        engine = Engine(
            dict(worlds),
            max_batch=max_batch,
            max_streams=max_sessions,
            max_kv_bytes=device_memory,
            pipeline=overlap_decode,
            defer_context=defer_clean_pass,
            retention=retention,
            deterministic=deterministic,
        )
        engine_thread = EngineThread(
            engine, asyncio.get_running_loop(), threads=threads, prompt_threads=prompt_threads
        )
        engine_thread.start()
        manager = SessionManager(
            engine_thread,
            default_model=default,
            max_sessions=max_sessions,
            detach_ttl_s=detach_ttl_s,
            allow_debug_hooks=debug_hooks,
            realtime_headroom=realtime_headroom,
            host_memory=host_memory,
            spill=None if spill_dir is None else StateStore(spill_dir),
            new_token=new_token,
        )
        return cls(engine_thread, manager)

    async def stop(self) -> None:
        """Close every session, then stop the engine thread (joined off the event loop) and free
        the device state of whatever streams it still held."""
        await self.manager.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self.engine_thread.close)
