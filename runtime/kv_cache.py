"""The logical view of KV caches: which frame sits in which slot, and who may have a cache at all.

Physical tensors live in `models.causal_wan.KVCache`, one per session, owned by the runner. This
module is CPU-only arithmetic. A session's cache has S sink slots and a ring of W slots, each
slot one latent frame of `tokens_per_frame` tokens::

    slot:   0 .. S-1        S .. S+W-1
          [ sinks (f < S) | ring: frame f >= S in slot S + (f - S) % W ]

With L committed frames, a chunk of n new frames (f = L .. L+n-1) writes its K/V into the slots
of those frames (scratch) and attends to the slot prefix [0, min(L + n, S + W)):

* while L + n <= S + W the slots fill in frame order, so the prefix is exactly frames [0, L+n);
* after that every slot is live: the sinks, the W - n most recent committed frames, the chunk.

The slots a chunk overwrites held frames older than the window, which no later chunk reads, so
a rollback needs no undo and a commit is just `L += n` (eviction is implicit, sinks stay).
Attention is order-free once RoPE has been applied, so ring order never matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.causal_wan import CacheSlots, KVCache


@dataclass(frozen=True)
class KVLayout:
    """Slot arithmetic for one model's caches."""

    sink_frames: int  # S: first frames kept forever
    window_frames: int  # W: ring slots (the local span, the current chunk included)
    tokens_per_frame: int  # tokens in one latent frame

    @property
    def capacity_frames(self) -> int:
        """Frame slots per session."""
        return self.sink_frames + self.window_frames

    def slot_of(self, frame: int) -> int:
        """Slot index of absolute latent frame `frame`."""
        s = self.sink_frames
        return frame if frame < s else s + (frame - s) % self.window_frames

    def attended(self, committed: int, n_new: int) -> list[int]:
        """Absolute committed frames a chunk of `n_new` frames after `committed` frames attends to."""
        s, w = self.sink_frames, self.window_frames
        sinks = list(range(min(s, committed)))
        local = list(range(max(s, committed - (w - n_new)), committed))
        return sinks + local

    def slots(self, committed: int, n_new: int, device: torch.device | str) -> CacheSlots:
        """Where a chunk of `n_new` frames following `committed` frames writes and what it reads."""
        if n_new > self.window_frames:
            raise ValueError(f"a chunk of {n_new} frames does not fit a window of {self.window_frames}")
        t = self.tokens_per_frame
        frame_slots = torch.tensor([self.slot_of(f) for f in range(committed, committed + n_new)])
        index = (frame_slots[:, None] * t + torch.arange(t)[None, :]).flatten().to(device)
        n_valid = min(committed + n_new, self.capacity_frames) * t
        return CacheSlots(write_index=index, n_valid=n_valid, frame_offset=committed)

    def committed_view(self, kv: KVCache, committed: int, n_next: int) -> dict[str, torch.Tensor]:
        """The K/V a next chunk of `n_next` frames would read, in frame order (for tests and export)."""
        t = self.tokens_per_frame
        frames = self.attended(committed, n_next)
        idx = torch.tensor([self.slot_of(f) * t + i for f in frames for i in range(t)], dtype=torch.long)
        idx = idx.to(kv.k.device)
        return {
            name: buf.index_select(1, idx)
            for name, buf in (("k", kv.k), ("v", kv.v), ("ak", kv.ak), ("av", kv.av))
        }


@dataclass(frozen=True)
class CacheAllocation:
    """A granted cache reservation."""

    stream_id: str  # owner
    nbytes: int  # device bytes reserved


class KVBudget:
    """Admission: at most `max_streams` caches and `max_bytes` of them (None: no byte limit)."""

    def __init__(self, max_streams: int, max_bytes: int | None = None) -> None:
        self.max_streams = max_streams
        self.max_bytes = max_bytes
        self._held: dict[str, CacheAllocation] = {}

    @property
    def used_bytes(self) -> int:
        """Bytes reserved now."""
        return sum(a.nbytes for a in self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    def allocate(self, stream_id: str, nbytes: int) -> CacheAllocation | None:
        """Reserve `nbytes` for `stream_id`, or None when it does not fit (the caller says busy)."""
        if stream_id in self._held:
            raise ValueError(f"stream {stream_id} already holds a cache")
        if len(self._held) >= self.max_streams:
            return None
        if self.max_bytes is not None and self.used_bytes + nbytes > self.max_bytes:
            return None
        alloc = CacheAllocation(stream_id, nbytes)
        self._held[stream_id] = alloc
        return alloc

    def free(self, stream_id: str) -> None:
        """Release a reservation (no-op when absent)."""
        self._held.pop(stream_id, None)
