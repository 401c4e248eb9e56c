"""``worldserve replay LOG.json --out video.mp4|frames.npz``: re-render a session log offline.

The log (``GET /v1/sessions/{id}/log``, web/sessionlog.py) names the model, seed, prompt, start
image and every committed chunk's per-frame actions; the replay runs them as a one-shot through
the same engine and `SessionManager.generate` that `worldserve generate` uses, with the
server's rewind retention (the same K/V ring layout). On the same device, dtype, torch threads
and batch layout (the session alone in its batches) the frames are bit-identical to the ones
the session was served (docs/ENGINE.md, "Reproducibility"). ``--out`` ending in ``.npz`` keeps
the raw frames (``frames``: every chunk's frames in order; ``start``: the start image, if any)
for a bit-exact comparison; anything else is an MP4 (web/video.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from web.sessionlog import SessionLog

if TYPE_CHECKING:
    from models.world import World
    from sessions.events import SessionEvent

__all__ = ["load_log", "render", "run"]


def load_log(path: Path) -> SessionLog:
    """A session log from a JSON file; ValueError saying what is wrong with it."""
    try:
        log = SessionLog.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ValueError(f"{path} is not a worldserve session log: {exc}") from exc
    if log.dropped:
        raise ValueError(
            f"{path}: the first {log.dropped} chunks of this world fell off the session's log; "
            "it cannot be replayed from the world's start"
        )
    return log


async def render(
    worlds: dict[str, World],
    log: SessionLog,
    sink: Callable[[SessionEvent], None],
    threads: int | None = None,
) -> int:
    """Run the log's chunks as one session on a fresh engine with the log's retention (and, from a
    --deterministic server, its padded batch size), events to
    `sink` (a `ReadyEvent` with the start frame, then one `FramesEvent` per chunk); returns the
    chunks rendered."""
    from sessions.manager import OpenParams
    from web.app import Runtime

    if log.model not in worlds:
        raise ValueError(f"the log's model {log.model!r} is not loaded (loaded: {sorted(worlds)})")
    batch = log.deterministic_batch
    runtime = Runtime.start(
        worlds,
        max_sessions=1,
        threads=threads,
        retention=log.retention,
        max_batch=batch or 1,
        deterministic=batch is not None,
    )
    try:
        params = OpenParams(model=log.model, seed=log.seed, prompt=log.prompt, image=log.start_image.image())
        actions = log.actions()
        done = await runtime.manager.generate(params, actions, len(actions), sink)
        return done.chunks
    finally:
        await runtime.stop()


def run(args: argparse.Namespace) -> int:
    """The LOG mode of ``worldserve replay``: exit 0 once written, 2 for a bad log or setting."""
    from sessions.events import FramesEvent, ReadyEvent
    from web import app
    from web.startup import StartupError, check_out, resolve_device, resolve_dtype

    try:
        if args.out is None:
            raise StartupError("replaying a session log needs --out video.mp4 or frames.npz")
        check_out(args.out)
        log = load_log(args.dir)
        device = resolve_device(args.device)
        worlds = app.load_worlds([args.model or log.model], device, resolve_dtype(args.dtype, device))
    except (StartupError, ValueError, KeyError, OSError) as exc:
        print(f"worldserve: error: {exc}", file=sys.stderr)
        return 2
    world = next(iter(worlds.values()))
    if world.spec.id != log.model:
        print(f"worldserve: error: {args.model} holds {world.spec.id}, not {log.model}", file=sys.stderr)
        return 2
    start: list[np.ndarray] = []
    chunks: list[np.ndarray] = []

    def sink(event: SessionEvent) -> None:
        if isinstance(event, ReadyEvent) and event.frame is not None:
            start.append(event.frame)
        elif isinstance(event, FramesEvent):
            chunks.append(event.frames)

    n = asyncio.run(render(worlds, log, sink, args.threads))
    spec = world.spec
    frames = np.concatenate(chunks) if chunks else np.zeros((0, spec.height, spec.width, 3), np.uint8)
    if args.out.suffix == ".npz":
        np.savez(args.out, frames=frames, **({"start": start[0]} if start else {}))
    else:
        from web.video import Mp4Writer

        writer = Mp4Writer(args.out, spec.width, spec.height, spec.fps)
        try:
            writer.write(np.concatenate([np.stack(start), frames]) if start else frames)
        finally:
            writer.close()
    print(f"worldserve: replayed {n} chunks ({len(frames)} frames) of session {log.session_id} to {args.out}")
    return 0
