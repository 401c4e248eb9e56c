"""Offload under a device budget (issue 43, item 3): N lockstep sessions of a world on a device
budget that holds K, host memory for H offloaded ones, the rest on disk. Each session runs
`before` steps and detaches (opening the next pushes the longest-detached off the device); then
every session is resumed in turn, newest first (`SessionManager.ensure_resident`: its world comes back,
pushing another off) and runs `after` more steps, which must equal an uninterrupted run of the
same seed and actions bit for bit (every step awaited alone: batches of one).

Reports the time to bring a session back to the device from host memory and from disk (p50 and
max over the sessions that came from there), the snapshot bytes per session, where the sessions
were before the resumes, the process's peak RSS, and a projection of the bring-back time of a
session of the same bytes over PCIe (bytes / 25 GB/s, a PCIe 4 x16 link's practical rate).

    python benchmarks/offload_resume.py [--model tiny-world] [--sessions 32] [--device-sessions 8]
                                        [--host-sessions 12] [--before 2] [--after 2] [--out FILE]

`--model mg-tiny`: the Matrix-Game 2.0 universal architecture at the test suite's reduced size
(tests/fixtures/golden/served.py: 24x16 frames, the tiny converted checkpoint, a random CLIP
tower and Wan VAE), started from a random image: its row holds the image conditioning and the
action ring besides the K/V.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import report
from models.actions import FrameAction
from models.registry import from_name, load_world
from runtime.engine import Engine, EngineThread
from sessions.events import FramesEvent
from sessions.manager import OpenParams, SessionManager
from sessions.store import StateStore

RESULTS = Path(__file__).parent / "results"
KEYS = ["w", "d", "s", "a"]
PCIE_BYTES_PER_S = 25e9


def script(i: int, steps: int) -> list[list[FrameAction]]:
    return [[FrameAction(frozenset({KEYS[(i + j) % 4]}))] for j in range(steps)]


class Inbox:
    def __init__(self) -> None:
        self.frames: list[FramesEvent] = []
        self.changed = asyncio.Event()

    def __call__(self, ev: object) -> None:
        if isinstance(ev, FramesEvent):
            self.frames.append(ev)
            self.changed.set()

    async def steps(self, session, actions, first_seq: int) -> list[np.ndarray]:
        out = []
        for j, a in enumerate(actions):
            have = len(self.frames)
            session.step(first_seq + j, a)
            while len(self.frames) == have:
                self.changed.clear()
                await self.changed.wait()
            session.ack(self.frames[-1].chunk)
            out.append(self.frames[-1].frames)
        return out


START: np.ndarray | None = None  # the start image of image-conditioned worlds (mg-tiny)


def params(seed: int) -> OpenParams:
    return OpenParams(seed=seed, mode="lockstep", image=START)


def manager_for(world, device_sessions: int, **kw) -> tuple[SessionManager, EngineThread]:
    engine = Engine({world.config.id: world}, max_batch=4, max_streams=device_sessions)
    et = EngineThread(engine, asyncio.get_running_loop())
    et.start()
    return SessionManager(et, default_model=world.config.id, max_sessions=1024, **kw), et


async def reference(world, n: int, steps: int) -> list[list[np.ndarray]]:
    m, et = manager_for(world, 1)
    out = []
    for i in range(n):
        s = await m.open(params(100 + i))
        inbox = Inbox()
        s.activate(inbox)
        out.append(await inbox.steps(s, script(i, steps), 0))
        await m.close(s)
    await m.shutdown()
    await asyncio.get_running_loop().run_in_executor(None, et.close)
    return out


async def scenario(world, n: int, k: int, h: int, before: int, after: int, spill: Path) -> dict:
    want = await reference(world, n, before + after)
    probe, et = manager_for(world, 1)
    s = await probe.open(params(1))
    inbox = Inbox()
    s.activate(inbox)
    await inbox.steps(s, script(0, before), 0)
    one = len((await probe.snapshot(s))[0])
    await probe.shutdown()
    await asyncio.get_running_loop().run_in_executor(None, et.close)

    m, et = manager_for(world, k, host_memory=int(one * (h + 0.5)), spill=StateStore(spill))
    sessions = []
    for i in range(n):
        s = await m.open(params(100 + i))
        inbox = Inbox()
        s.activate(inbox)
        await inbox.steps(s, script(i, before), 0)
        s.detach()
        sessions.append(s)
    where_before = {w: n_b for w, n_b in m.residence().items()}
    times: dict[str, list[float]] = {"host": [], "disk": [], "device": []}
    equal = 0
    for i, s in reversed(list(enumerate(sessions))):  # newest first: some still in host memory
        where = m.offloaded(s) or "device"
        t0 = time.perf_counter()
        await m.ensure_resident(s)
        times[where].append(time.perf_counter() - t0)
        inbox = Inbox()
        s.activate(inbox)
        got = await inbox.steps(s, script(i, before + after)[before:], before)
        equal += all(np.array_equal(x, y) for x, y in zip(want[i][before:], got, strict=True))
        s.detach()
    await m.shutdown()
    await asyncio.get_running_loop().run_in_executor(None, et.close)

    def ms(xs: list[float]) -> dict[str, float] | None:
        return {"p50": round(1000 * float(np.median(xs)), 2), "max": round(1000 * max(xs), 2)} if xs else None

    return {
        "sessions": n,
        "device_sessions": k,
        "host_sessions": h,
        "snapshot_bytes_per_session": one,
        "where_before_resumes": {w: {"sessions": c, "bytes": b} for w, (c, b) in where_before.items()},
        "bring_back_ms_from_host": ms(times["host"]),
        "bring_back_ms_from_disk": ms(times["disk"]),
        "projected_pcie_ms_per_session": round(1000 * one / PCIE_BYTES_PER_S, 3),
        "bit_identical": equal,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def load(model: str, tmp: Path):
    """The world to run: a registry name, or mg-tiny (see the module docstring)."""
    global START
    if model != "mg-tiny":
        return from_name(model)
    from tests.fixtures.golden.served import write_matrix_game_dir

    START = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    (tmp / "mg").mkdir()
    return load_world(write_matrix_game_dir(tmp / "mg"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--device-sessions", type=int, default=8)
    parser.add_argument("--host-sessions", type=int, default=12)
    parser.add_argument("--before", type=int, default=2)
    parser.add_argument("--after", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "offload_resume.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        world = load(args.model, Path(tmp))
        run = scenario(
            world, args.sessions, args.device_sessions, args.host_sessions, args.before, args.after, Path(tmp)
        )
        figures = asyncio.run(run)
    report(args.out, "offload_resume", model=args.model, **figures)


if __name__ == "__main__":
    main()
