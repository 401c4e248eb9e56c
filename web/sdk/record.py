"""Recorded episodes: one directory per episode, written as it runs, read back for replay.

    episode-00003/
      frames.npz      every chunk's frames, raw (T, H, W, 3) uint8 arrays "c000001", "c000002", ...
      episode.mp4     or the episode as H.264 (lossy; smaller)
      actions.jsonl   one line per chunk: {"chunk", "frame0", "frames", "actions": [FrameAction...]}
      start_image.npy the start image, when the world was started from one
      meta.json       model, seed, start image file, server, ...; written last: it marks the
                      episode complete

``chunk`` counts from 1 within the world and ``frame0`` from 0 (an image-started world's start
frame is frame 0). Frames are appended chunk by chunk (the npz is a zip written entry by entry),
so an episode never sits in memory. :class:`RecordEpisode` records a :class:`WorldEnv`.
"""

import importlib.metadata
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from web import messages as m
from web.sdk.spaces import wire_json
from web.video import Mp4Writer

__all__ = [
    "Episode",
    "EpisodeWriter",
    "RecordEpisode",
    "VideoFormat",
    "episode_meta",
    "is_complete",
    "read_episode",
]

VideoFormat = Literal["npz", "mp4"]
META, ACTIONS, START_IMAGE = "meta.json", "actions.jsonl", "start_image.npy"
VIDEO_FILES = {"npz": "frames.npz", "mp4": "episode.mp4"}
FORMAT_VERSION = 1


def client_version() -> str | None:
    """This worldserve package's version (the server publishes none over the protocol)."""
    try:
        return importlib.metadata.version("worldserve")
    except importlib.metadata.PackageNotFoundError:
        return None


def episode_meta(
    ready: m.Ready, url: str, seed: int, image: np.ndarray | None, per_frame: bool
) -> dict[str, Any]:
    """The ``meta.json`` fields known when an episode starts."""
    model = ready.model
    return {
        "format": FORMAT_VERSION,
        "model": model.id,
        "weights_sha256": None,  # not published by the server (protocol v1 has no field for it)
        "seed": seed,
        "start_image": None if image is None else START_IMAGE,
        "server": {"url": url, "protocol": ready.protocol, "version": None},
        "client_version": client_version(),
        "codec": ready.codec.name,
        "fps": model.fps,
        "width": model.width,
        "height": model.height,
        "chunk_frames": model.chunk_frames,
        "action_space": model.action_space.model_dump(mode="json"),
        "per_frame": per_frame,
    }


def is_complete(directory: Path) -> bool:
    """True once an episode's ``meta.json`` is written (rollouts skip these)."""
    return (directory / META).is_file()


class EpisodeWriter:
    """Writes one episode directory chunk by chunk; :meth:`close` finishes it with ``meta.json``."""

    def __init__(
        self, directory: Path, meta: dict[str, Any], image: np.ndarray | None, video: VideoFormat = "npz"
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in (META, ACTIONS, START_IMAGE, *VIDEO_FILES.values()):  # an unfinished earlier try
            (self.directory / stale).unlink(missing_ok=True)
        self.meta = {**meta, "video": VIDEO_FILES[video]}
        if image is not None:
            np.save(self.directory / START_IMAGE, image)
        self.chunks = 0
        self.frames = 0
        self._actions = (self.directory / ACTIONS).open("w")
        path = self.directory / VIDEO_FILES[video]
        self._zip = zipfile.ZipFile(path, "w") if video == "npz" else None
        self._mp4 = Mp4Writer(path, meta["width"], meta["height"], meta["fps"]) if video == "mp4" else None

    def add(self, chunk: int, frame0: int, frames: np.ndarray, actions: tuple[m.FrameAction, ...]) -> None:
        """Append one chunk: its frames (T, H, W, 3) and the actions that made it."""
        line = {"chunk": chunk, "frame0": frame0, "frames": len(frames), "actions": wire_json(actions)}
        self._actions.write(json.dumps(line) + "\n")
        if self._zip is not None:
            with self._zip.open(f"c{chunk:06d}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(frames), allow_pickle=False)
        else:
            assert self._mp4 is not None
            self._mp4.write(frames)
        self.chunks += 1
        self.frames += len(frames)

    def close(self) -> None:
        """Finish the files, then write ``meta.json`` (atomically: it marks the episode complete)."""
        self._actions.close()
        if self._zip is not None:
            self._zip.close()
        if self._mp4 is not None:
            self._mp4.close()
        meta = {**self.meta, "chunks": self.chunks, "frames": self.frames}
        tmp = self.directory / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, self.directory / META)


@dataclass(frozen=True)
class Episode:
    """A recorded episode, read back."""

    directory: Path
    meta: dict[str, Any]
    steps: list[dict[str, Any]]  # the actions.jsonl lines, in order
    frames: list[np.ndarray]  # per chunk, (T, H, W, 3) uint8 (decoded from the MP4 when lossy)
    start_image: np.ndarray | None

    @property
    def lossless(self) -> bool:
        return self.meta["video"] == VIDEO_FILES["npz"]

    def actions(self, i: int) -> tuple[m.FrameAction, ...]:
        """Chunk i's protocol actions."""
        return tuple(m.FrameAction(**a) for a in _arrays(self.steps[i]["actions"]))


def _arrays(actions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**a, **({"vector": np.asarray(a["vector"], np.float32)} if "vector" in a else {})} for a in actions
    ]


def read_episode(directory: str | Path) -> Episode:
    """Read a complete episode directory (ValueError when it is not one)."""
    directory = Path(directory)
    if not is_complete(directory):
        raise ValueError(f"{directory} is not a complete episode (no {META})")
    meta = json.loads((directory / META).read_text())
    steps = [json.loads(line) for line in (directory / ACTIONS).read_text().splitlines() if line]
    video = directory / meta["video"]
    if meta["video"] == VIDEO_FILES["npz"]:
        with np.load(video) as npz:
            frames = [npz[f"c{s['chunk']:06d}"] for s in steps]
    else:
        frames = _split(_decode_mp4(video), [s["frames"] for s in steps])
    image = np.load(directory / START_IMAGE) if meta["start_image"] else None
    return Episode(directory, meta, steps, frames, image)


def _decode_mp4(path: Path) -> np.ndarray:
    import av  # only for lossy recordings

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _split(frames: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    if len(frames) != sum(counts):
        raise ValueError(f"the video has {len(frames)} frames, actions.jsonl names {sum(counts)}")
    return np.split(frames, np.cumsum(counts)[:-1]) if counts else []


class RecordEpisode(gym.Wrapper):
    """Record every episode of a :class:`~web.sdk.gym_env.WorldEnv` under ``directory``
    (``episode-00000``, ``episode-00001``, ...). An episode is finished when it terminates or
    truncates, at the next ``reset``, or at ``close``."""

    def __init__(self, env: gym.Env, directory: str | Path, video: VideoFormat = "npz") -> None:
        super().__init__(env)
        self.directory = Path(directory)
        self.video: VideoFormat = video
        self.episodes = 0  # episodes started
        self._writer: EpisodeWriter | None = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self._finish()
        obs, info = self.env.reset(**kwargs)
        env = self.env.unwrapped
        world = env.world
        meta = episode_meta(world.durable.ready, world.url, world.seed, world.image, world.per_frame)
        self._writer = EpisodeWriter(
            self.directory / f"episode-{self.episodes:05d}", meta, world.image, self.video
        )
        self.episodes += 1
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        world = self.env.unwrapped.world
        if self._writer is not None:
            self._writer.add(info["chunk"], info["frame0"], world.last_chunk.frames, world.last_actions)
        if terminated or truncated:
            self._finish()
        return obs, reward, terminated, truncated, info

    def _finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        self._finish()
        super().close()
