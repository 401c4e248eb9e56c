"""The logical view of KV caches: which frame sits in which slot, and who may have a cache at all.

Physical tensors live in the model's static pool (`models.kv_pool.KVPool`, one row per session).
This module is host-side arithmetic: it turns (row, committed length) pairs into the small
`ChunkIndex` tensors of one step, built with numpy and copied to the device once (from pinned
memory on CUDA, non-blocking). A session's row has S sink slots and a ring of W slots, each slot
one latent frame of `tokens_per_frame` tokens::

    slot:   0 .. S-1        S .. S+R-1                         R = W + slack
          [ sinks (f < S) | ring: frame f >= S in slot S + (f - S) % R ]

With L frames before it, a chunk of n new frames (f = L .. L+n-1) writes its K/V into the slots
of those frames (scratch) and attends, under a per-slot mask (`valid_frames`), to the sinks, the
W - n most recent frames before it and itself. Attention is order-free once RoPE has been
applied, so ring order never matters.

The slots a chunk overwrites held frames older than its window. Without slack (R = W) those are
frames no later chunk reads, so a rollback needs no undo and a commit is just `L += n`. With a
pipelined decode a chunk runs on top of its predecessor's *uncommitted* scratch; should the
predecessor roll back, its retry reads the n frames the successor's writes would have hit in a
ring of W. `slack` = n extra ring slots keep those frames intact: two chunks of a stream may be
in flight and a rollback of both still needs no undo.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.kv_pool import ChunkIndex, HostIndex, KVPool, motion_slots


@dataclass(frozen=True)
class KVLayout:
    """Slot arithmetic for one model's caches."""

    sink_frames: int  # S: first frames kept forever
    window_frames: int  # W: the local span in frames, the current chunk included
    tokens_per_frame: int  # tokens in one latent frame
    slack_frames: int = 0  # ring slots beyond W: room for a second chunk in flight (pipelined decode)

    @property
    def ring_frames(self) -> int:
        """R: frame slots of the ring."""
        return self.window_frames + self.slack_frames

    @property
    def capacity_frames(self) -> int:
        """Frame slots per session."""
        return self.sink_frames + self.ring_frames

    def slot_of(self, frame: int) -> int:
        """Slot index of absolute latent frame `frame`."""
        s = self.sink_frames
        return frame if frame < s else s + (frame - s) % self.ring_frames

    def attended(self, committed: int, n_new: int) -> list[int]:
        """Absolute committed frames a chunk of `n_new` frames after `committed` frames attends to."""
        s, w = self.sink_frames, self.window_frames
        sinks = list(range(min(s, committed)))
        local = list(range(max(s, committed - (w - n_new)), committed))
        return sinks + local

    def write_slots(self, committed: int, n_new: int) -> np.ndarray:
        """Token slots (n_new * tokens_per_frame,) a chunk of `n_new` frames after `committed` writes."""
        if n_new > self.window_frames:
            raise ValueError(f"a chunk of {n_new} frames does not fit a window of {self.window_frames}")
        frames = np.arange(committed, committed + n_new)
        s = self.sink_frames
        frame_slots = np.where(frames < s, frames, s + (frames - s) % self.ring_frames)
        t = self.tokens_per_frame
        return (frame_slots[:, None] * t + np.arange(t)[None, :]).reshape(-1)

    def valid_frames(self, committed: int, n_new: int) -> np.ndarray:
        """(capacity_frames,) bool: the frame slots a chunk of `n_new` frames after `committed`
        attends to (the attended frames and the chunk itself)."""
        frames = [*self.attended(committed, n_new), *range(committed, committed + n_new)]
        valid = np.zeros(self.capacity_frames, dtype=bool)
        valid[[self.slot_of(f) for f in frames]] = True
        return valid

    def index(
        self,
        rows: list[int | None],
        committed: list[int],
        n_new: int,
        pad_row: int,
        bucket: int | None = None,
        device: torch.device | str = "cpu",
        separate: bool = False,
    ) -> ChunkIndex:
        """The `ChunkIndex` of one step: entry i is pool row `rows[i]` after `committed[i]` frames.

        Entries whose row is None, and with `bucket` the entries past len(rows), are padding:
        they write and read `pad_row` (their outputs are discarded). Vectorised over entries (no
        loop per session); one host buffer (pinned on CUDA), one non-blocking copy to the device.
        The host copy of each entry's row and read span (`HostIndex`) stays with the index, so
        attention reads each row in place without reading a device value. `separate`: every entry
        attends on its own (`HostIndex.separate`).
        """
        b = bucket or len(rows)
        if b < len(rows):
            raise ValueError(f"{len(rows)} entries do not fit a bucket of {b}")
        if n_new > self.window_frames:
            raise ValueError(f"a chunk of {n_new} frames does not fit a window of {self.window_frames}")
        nt = n_new * self.tokens_per_frame
        f = self.capacity_frames
        device = torch.device(device)
        live = np.array([r is not None for r in rows] + [False] * (b - len(rows)))
        row = np.full(b, pad_row, dtype=np.int64)
        done = np.zeros(b, dtype=np.int64)
        row[: len(rows)] = [pad_row if r is None else r for r in rows]
        done[: len(rows)] = committed
        done[~live] = 0
        valid = self._valid_batch(done, n_new)
        host = torch.empty((b, 2 + nt + f), dtype=torch.long, pin_memory=device.type == "cuda")
        buf = host.numpy()
        buf[:, 0], buf[:, 1] = row, done
        buf[:, 2 : 2 + nt] = self._write_batch(done, n_new)
        buf[:, 2 + nt :] = valid
        dev = host.to(device, non_blocking=True)
        return ChunkIndex(
            rows=dev[:, 0],
            write=dev[:, 2 : 2 + nt],
            valid=dev[:, 2 + nt :].bool(),
            frame_offset=dev[:, 1],
            host=HostIndex.of(row, valid, separate),
        )

    def recache_frames(self, committed: int) -> range:
        """The frames a prompt switch after `committed` frames re-caches (LongLive's rule): the
        last sink + window frames, all of them while there are no more; beyond that the last
        `window` frames (the sinks keep the K/V they have)."""
        span = self.sink_frames + self.window_frames
        first = 0 if committed <= span else committed - self.window_frames
        return range(first, committed)

    def recache_index(self, row: int, committed: int, device: torch.device | str = "cpu") -> ChunkIndex:
        """The `ChunkIndex` of the re-cache pass of row `row` after `committed` (> 0) frames: it
        writes the `recache_frames` and attends to them and the sinks."""
        frames = self.recache_frames(committed)
        t = self.tokens_per_frame
        slots = np.array([self.slot_of(f) for f in frames])
        write = (slots[:, None] * t + np.arange(t)[None, :]).reshape(1, -1)
        valid = np.zeros((1, self.capacity_frames), dtype=bool)
        valid[0, [self.slot_of(f) for f in range(min(self.sink_frames, committed))]] = True
        valid[0, slots] = True
        dev = torch.device(device)
        return ChunkIndex(
            rows=torch.tensor([row], device=dev),
            write=torch.from_numpy(write).to(dev),
            valid=torch.from_numpy(valid).to(dev),
            frame_offset=torch.tensor([frames.start], device=dev),
            host=HostIndex.of(np.array([row]), valid),
        )

    def _write_batch(self, committed: np.ndarray, n_new: int) -> np.ndarray:
        """(B, n_new * tokens_per_frame): `write_slots` of every entry at once."""
        frames = committed[:, None] + np.arange(n_new)[None, :]
        s = self.sink_frames
        slots = np.where(frames < s, frames, s + (frames - s) % self.ring_frames)
        t = self.tokens_per_frame
        return (slots[:, :, None] * t + np.arange(t)).reshape(len(committed), -1)

    def _valid_batch(self, committed: np.ndarray, n_new: int) -> np.ndarray:
        """(B, capacity_frames) bool: `valid_frames` of every entry at once. A sink slot j holds
        frame j (valid once written, the chunk's included); the non-sink frames read are the
        last min(W, L + n - S) up to the chunk's end, consecutive ring positions ending at the
        chunk's last frame."""
        s, r = self.sink_frames, self.ring_frames
        end = committed + n_new  # frames once the chunk is in
        sinks = np.arange(s)[None, :] < end[:, None]
        m = np.clip(np.minimum(self.window_frames, end - s), 0, None)
        last = (end - 1 - s) % r
        ring = (last[:, None] - np.arange(r)[None, :]) % r < m[:, None]
        return np.concatenate([sinks, ring], axis=1)

    def committed_view(self, pool: KVPool, row: int, committed: int, n_next: int) -> dict[str, torch.Tensor]:
        """The K/V of pool row `row` a next chunk of `n_next` frames would read, in frame order
        (for tests and export); text K/V whole."""
        t = self.tokens_per_frame
        frames = self.attended(committed, n_next)
        idx = torch.tensor([self.slot_of(f) * t + i for f in frames for i in range(t)], dtype=torch.long)
        view = pool.row_view(row)
        idx = idx.to(view["k"].device)
        motion = motion_slots(idx, t, self.capacity_frames)  # the action K/V is position-major
        out = {name: view[name].index_select(1, idx) for name in ("k", "v")}
        out |= {name: view[name].index_select(1, motion) for name in ("ak", "av")}
        return out | {"tk": view["tk"], "tv": view["tv"]}
