"""Play a recorded episode back through a server and compare the frames with the recording.

A world's frames depend only on its model, seed, start image and actions, so a replay on the same
machine and settings is bit-identical to the recording. Elsewhere (other hardware, another
batch composition on the server, or a lossy MP4 recording) it is compared by PSNR.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from web import messages as m
from web.sdk.durable import DurableSession
from web.sdk.gym_env import start_frame
from web.sdk.record import Episode, read_episode

__all__ = ["ReplayReport", "psnr", "replay"]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 arrays, dB (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def _psnr_of(squared: float, values: int) -> float:
    if values == 0:
        return 0.0
    return float("inf") if squared == 0 else float(10 * np.log10(255**2 * values / squared))


@dataclass(frozen=True)
class ReplayReport:
    """How a replay compares with its recording."""

    chunks: int  # chunks replayed
    frames: int  # frames compared
    identical: bool  # every frame bit-identical (and the same chunk and frame numbers)
    psnr_min: float  # worst chunk, dB (inf when identical)
    psnr_all: float  # over every frame of the episode, dB
    first_mismatch: int | None  # first chunk that differs, None if none
    lossless: bool  # the recording holds raw frames (an MP4 recording can never be identical)

    def summary(self) -> str:
        """One line for the CLI."""
        if self.identical:
            return f"replay: {self.chunks} chunks, {self.frames} frames: bit-identical"
        return (
            f"replay: {self.chunks} chunks, {self.frames} frames: differ from chunk {self.first_mismatch}; "
            f"PSNR worst chunk {self.psnr_min:.2f} dB, episode {self.psnr_all:.2f} dB"
            + ("" if self.lossless else " (the recording is a lossy MP4)")
        )


async def replay(url: str, episode: Episode | str | Path, token: str | None = None) -> ReplayReport:
    """Run the episode's actions in a new lockstep session and compare every chunk."""
    ep = episode if isinstance(episode, Episode) else read_episode(episode)
    meta = ep.meta
    open_msg = m.Open(
        model=meta["model"],
        seed=meta["seed"],
        image=ep.start_image,
        mode="lockstep",
        codec="raw",
        token=token,
    )
    session = DurableSession(url, open_msg)
    ready = await session.open()
    seen = 0 if start_frame(ready) is None else 1
    scores: list[float] = []
    squared, values = 0.0, 0  # squared error over the episode, for its PSNR
    first_mismatch = None
    try:
        for i, (step, want) in enumerate(zip(ep.steps, ep.frames, strict=True)):
            chunk = await session.step(ep.actions(i))
            same_numbers = (chunk.chunk - ready.chunk, seen) == (step["chunk"], step["frame0"])
            seen += len(chunk.frames)
            same = same_numbers and chunk.frames.shape == want.shape and np.array_equal(chunk.frames, want)
            if chunk.frames.shape == want.shape:
                scores.append(psnr(chunk.frames, want))
                squared += float(np.sum((chunk.frames.astype(np.float64) - want) ** 2))
                values += want.size
            else:
                scores.append(0.0)
            if not same and first_mismatch is None:
                first_mismatch = step["chunk"]
    finally:
        await session.close()
    return ReplayReport(
        chunks=len(scores),
        frames=sum(len(f) for f in ep.frames),
        identical=first_mismatch is None,
        psnr_min=min(scores, default=float("inf")),
        psnr_all=_psnr_of(squared, values),
        first_mismatch=first_mismatch,
        lossless=ep.lossless,
    )
