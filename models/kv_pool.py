"""The static K/V pool of a causal Wan and the two attention backends its blocks call.

gpt-fast's `setup_caches` idea with vLLM's logical/physical split: the model preallocates, per
layer, K/V for a fixed number of session *rows* (plus one padding row), each row holding
(sink + window) frame slots. A session owns a row; where its chunk writes and how much it reads
is a `ChunkIndex` of small tensors the runtime computes once per step (runtime/kv_cache.py).
Text K/V (cross-attention) and the action module's temporal K/V live in the same pool.

Attention reads the pool where it is. Eager (the default, CPU and CUDA), the batch's entries on
consecutive rows (a run) attend in one call over a view of those rows, cut at the last slot any
of them reads (`HostIndex.spans`: while a window fills, only the filled prefix), with no mask
unless an entry reads less than that or its prefix holds a slot it must not read (the ring slack
of a pipelined decode); text K/V likewise, cut at the rows' text length. No K/V is gathered or
copied. Compiled (`World.compile`: one static graph per batch bucket, CUDA graphs
need device-resident indices), every entry instead gathers its whole row and reads it under a
per-slot mask (`ChunkIndex.valid`), so the shapes of a step depend on the batch size only.
docs/ENGINE.md ("Attention over the pool") has the measurements behind the choice.

Row layout along the token axis (frames of `tokens_per_frame` tokens each)::

    [ sink frames 0..S-1 | ring of R frame slots ]   (R = window + slack; runtime/kv_cache.py)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HostIndex:
    """The host's copy of what each batch entry reads: plain ints, so reading a row in place
    needs no device value."""

    rows: tuple[int, ...]  # pool row of each entry
    spans: tuple[int, ...]  # frame slots each entry reads: its row's prefix up to its last valid slot
    holes: tuple[bool, ...]  # whether that prefix holds slots the entry must not read (a mask is needed)
    # Every entry attends on its own (no run of rows shares a call), so what an entry computes
    # does not depend on its neighbours' fill (deterministic serving, runtime/batch.py).
    separate: bool = False

    @classmethod
    def of(cls, rows: np.ndarray, valid: np.ndarray, separate: bool = False) -> HostIndex:
        """From rows (B,) and the valid frame slots (B, frames) bool (every entry reads its chunk)."""
        frames = valid.shape[1]
        spans = frames - np.argmax(valid[:, ::-1], axis=1)
        inside = np.arange(frames)[None, :] < spans[:, None]
        holes = (valid & inside).sum(axis=1) < spans
        return cls(tuple(rows.tolist()), tuple(spans.tolist()), tuple(holes.tolist()), separate)


@dataclass
class ChunkIndex:
    """Where each batch entry's chunk lives in the pool (device tensors, one set per step)."""

    rows: torch.Tensor  # (B,) int64 pool row of each entry; padding entries use the pool's pad row
    write: torch.Tensor  # (B, n * tokens_per_frame) int64 token slots (within the row) of the chunk
    valid: torch.Tensor  # (B, frame slots) bool: the frame slots the entry attends to (its chunk's included)
    frame_offset: torch.Tensor  # (B,) int64 absolute latent frame of the chunk's first frame (RoPE)
    host: HostIndex | None = None  # the host's copy of rows and spans (runtime/kv_cache.py builds it)

    def host_index(self) -> HostIndex:
        """`host`, or for an index built without one (training) derived from the device tensors
        (a device read: the runtime's indexes always carry theirs)."""
        if self.host is None:
            self.host = HostIndex.of(self.rows.cpu().numpy(), self.valid.cpu().numpy())
        return self.host


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over (..., L, heads, head_dim) tensors; returns (..., Lq, heads, head_dim).

    With a batch dimension the call is 4-D (B, heads, L, head_dim), the layout the fused kernels take.
    """
    out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), mask)
    return out.transpose(-3, -2)


def _frames_major(x: torch.Tensor, t: int) -> torch.Tensor:
    """(B, F*T, heads, hd) -> (B*T, F, heads, hd): attention then runs along frames per position."""
    return x.unflatten(1, (-1, t)).transpose(1, 2).flatten(0, 1)


def motion_slots(token_slots: torch.Tensor, tokens_per_frame: int, frame_slots: int) -> torch.Tensor:
    """Token slots (frame-major: frame slot * T + position) -> their slots in the action K/V
    (`KVPool.ak`, position-major: position * frame slots + frame slot)."""
    return (token_slots % tokens_per_frame) * frame_slots + token_slots // tokens_per_frame


class KVPool(nn.Module):
    """Preallocated K/V of `rows` sessions (+ a padding row) for every layer.

    Buffers are non-persistent: they follow `.to()` with the model but never enter a state dict.
    """

    def __init__(
        self,
        rows: int,
        layers: int,
        capacity: int,
        heads: int,
        head_dim: int,
        text_tokens: int,
        action_layers: int = 0,
        action_heads: int = 1,
        action_head_dim: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        extras: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__()
        if rows < 1:
            raise ValueError("a pool needs at least one session row")
        self.rows = rows
        self.capacity = capacity
        # Row ownership lives with the pool, so worlds sharing a transformer share it too.
        self.owner: dict[int, int] = {}  # row -> lease of the state holding it
        self.leases = itertools.count(1)
        r = rows + 1  # the last row takes padding entries' writes
        z = dict(dtype=dtype, device=device)
        self.register_buffer("k", torch.zeros(layers, r, capacity, heads, head_dim, **z), persistent=False)
        self.register_buffer("v", torch.zeros_like(self.k), persistent=False)
        # The action module's temporal K/V, position-major (`motion_slots`): the attention along
        # frames at every spatial position reads a view of a row.
        shape = (action_layers, r, capacity, action_heads, action_head_dim)
        self.register_buffer("ak", torch.zeros(shape, **z), persistent=False)
        self.register_buffer("av", torch.zeros_like(self.ak), persistent=False)
        text = torch.zeros(layers, r, text_tokens, heads, head_dim, **z)
        self.register_buffer("tk", text, persistent=False)
        self.register_buffer("tv", torch.zeros_like(self.tk), persistent=False)
        # Per-row tensors a model keeps with the session (Matrix-Game: its image conditioning and a
        # ring of raw action frames), shaped (1, rows + 1, *shape) so every row operation covers them.
        self.extras = tuple(extras or {})
        for name, shape in (extras or {}).items():
            self.register_buffer(name, torch.zeros(1, r, *shape, **z), persistent=False)
        # Text tokens per row; the padding row attends to one (zero) token so its softmax is finite.
        self.register_buffer("text_len", torch.ones(r, dtype=torch.long, device=device), persistent=False)
        self.text_lens = [1] * r  # the host's copy of `text_len`: rows are cut at it in place

    @property
    def pad_row(self) -> int:
        """The row padding entries of a batch bucket write to and read from."""
        return self.rows

    @property
    def text_tokens(self) -> int:
        """Text tokens a row holds at most."""
        return self.tk.shape[2]

    def _names_of_rows(self) -> tuple[str, ...]:
        return ("k", "v", "ak", "av", "tk", "tv", *self.extras)

    def _buffers_of_rows(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._names_of_rows()]

    def row_nbytes(self) -> int:
        """Device bytes one session row holds (every layer's K/V, action K/V, text K/V, extras)."""
        return sum(b[:, 0].numel() * b.element_size() for b in self._buffers_of_rows())

    def nbytes(self) -> int:
        """Device bytes of the whole pool."""
        return sum(b.numel() * b.element_size() for b in self._buffers_of_rows())

    @torch.no_grad()
    def copy_row(self, src: int, dst: int) -> None:
        """Make row `dst` a copy of row `src` (fork)."""
        for b in self._buffers_of_rows():
            b[:, dst].copy_(b[:, src])
        self.text_len[dst] = self.text_len[src]
        self.text_lens[dst] = self.text_lens[src]

    @torch.no_grad()
    def clear_row(self, row: int) -> None:
        """Zero row `row` for a new owner: masked slots still meet their values in SDPA's
        products (0 x NaN is NaN), so nothing a previous owner left may survive the lease."""
        for b in self._buffers_of_rows():
            b[:, row].zero_()
        self.text_len[row] = 1
        self.text_lens[row] = 1

    @torch.no_grad()
    def scrub_row(self, row: int) -> None:
        """Zero every non-finite value of row `row`. Masked slots still meet the values in SDPA's
        products, so a rolled-back chunk's NaN K/V must not linger where no write will hit them
        before they are read (the slack of a pipelined ring)."""
        for b in self._buffers_of_rows():
            torch.nan_to_num_(b[:, row], nan=0.0, posinf=0.0, neginf=0.0)

    @torch.no_grad()
    def copy_rows_from(self, other: KVPool) -> None:
        """Take over the session rows and leases of a pool of the same row shape (resizing a
        pool); shrinking, every held row must be below the new row count."""
        n = min(self.rows, other.rows)
        if any(row >= n for row in other.owner):
            raise ValueError(f"a held row lies past the new pool's {n} rows")
        self.owner, self.leases = dict(other.owner), other.leases
        for mine, theirs in zip(self._buffers_of_rows(), other._buffers_of_rows(), strict=True):
            mine[:, :n].copy_(theirs[:, :n])
        self.text_len[:n] = other.text_len[:n]
        self.text_lens[:n] = other.text_lens[:n]

    @torch.no_grad()
    def set_text(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Store one session's per-layer text K/V (L_text, heads, head_dim) in `row`."""
        n = k[0].shape[0]
        if n > self.text_tokens:
            raise ValueError(f"{n} text tokens exceed the pool's {self.text_tokens}")
        for layer, (kl, vl) in enumerate(zip(k, v, strict=True)):
            self.tk[layer, row].zero_()
            self.tv[layer, row].zero_()
            self.tk[layer, row, :n] = kl
            self.tv[layer, row, :n] = vl
        self.text_len[row] = n
        self.text_lens[row] = n

    def row_view(self, row: int) -> dict[str, torch.Tensor]:
        """Row `row` of every K/V buffer (views: for tests, export and residency checks)."""
        return {
            name: b[:, row] for name, b in zip(self._names_of_rows(), self._buffers_of_rows(), strict=True)
        }


@dataclass(frozen=True)
class Run:
    """Batch entries whose rows follow each other in the pool: one attention call over a view."""

    first: int  # position of its first entry in row order
    size: int  # entries (rows row .. row + size - 1)
    row: int  # pool row of its first entry
    span: int  # frame slots read: the longest of its entries' spans
    mask: torch.Tensor | None  # (size, 1, 1, span) valid frame slots; None: every entry reads all of span


def runs_of(index: ChunkIndex) -> tuple[list[int] | None, list[Run]]:
    """The order that sorts the batch entries by row (None: already sorted) and its runs of
    consecutive rows (each entry its own run when `HostIndex.separate`). Entries of a run read
    one view of the pool; entries with a shorter span or slots they must not read get a mask."""
    host = index.host_index()
    b = len(host.rows)
    order = sorted(range(b), key=lambda i: host.rows[i])
    valid = index.valid if order == list(range(b)) else index.valid[order]
    runs, i = [], 0
    while i < b:
        j = i + 1
        while j < b and not host.separate and host.rows[order[j]] == host.rows[order[j - 1]] + 1:
            j += 1
        members = order[i:j]
        span = max(host.spans[m] for m in members)
        masked = any(host.holes[m] or host.spans[m] != span for m in members)
        mask = valid[i:j, :span][:, None, None] if masked else None
        runs.append(Run(i, j - i, host.rows[order[i]], span, mask))
        i = j
    return (None if order == list(range(b)) else order), runs


class PoolAttention:
    """The chunk forward's attention: every entry writes its chunk into its row, then reads its
    row in place (eager: one call per run of consecutive rows, cut at the run's longest filled
    prefix) or gathered under a mask (compiled); one write per layer for the whole batch."""

    def __init__(
        self,
        pool: KVPool,
        index: ChunkIndex,
        tokens_per_frame: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        motion_rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self.pool = pool
        self.index = index
        self.tokens_per_frame = tokens_per_frame
        self.rope = rope  # (B, L, 1, head_dim) cos, sin
        self.motion_rope = motion_rope  # (B, L, 1, action head_dim) cos, sin; one position per frame
        rows, t = index.rows, tokens_per_frame
        self._put = (rows[:, None], index.write)
        self._put_frames = (rows[:, None], index.write[:, ::t] // t)  # (B, n) frame slots of the chunk
        self.frame_slots = pool.capacity // t
        self._put_motion = (rows[:, None], motion_slots(index.write, t, self.frame_slots))
        # Compiled graphs take shapes that depend on the batch size only: gather under a mask.
        self.gather = torch.compiler.is_compiling()
        if self.gather:
            self._gather_masks(index, t)
            return
        order, self.runs = runs_of(index)
        dev = rows.device
        self.order = None if order is None else torch.tensor(order, device=dev)
        self.unorder = (
            None
            if order is None
            else torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=dev)
        )
        self.token_masks = [None if r.mask is None else r.mask.repeat_interleave(t, -1) for r in self.runs]
        # Text: a run reads up to its longest text, masking the shorter ones (pad rows hold one).
        lens = pool.text_lens
        self.text_spans = [max(lens[r.row : r.row + r.size]) for r in self.runs]
        self.text_masks: list[torch.Tensor | None] = []
        for r, span in zip(self.runs, self.text_spans, strict=True):
            same = all(n == span for n in lens[r.row : r.row + r.size])
            slots = torch.arange(span, device=dev)
            tl = pool.text_len[r.row : r.row + r.size]
            self.text_masks.append(None if same else (slots[None] < tl[:, None])[:, None, None])

    def _gather_masks(self, index: ChunkIndex, t: int) -> None:
        rows, dev = index.rows, index.rows.device
        self.self_mask = index.valid.repeat_interleave(t, dim=1)[:, None, None, :]  # (B, 1, 1, cap)
        tslot = torch.arange(self.pool.text_tokens, device=dev)
        text_len = self.pool.text_len.index_select(0, rows)
        self.text_mask = (tslot[None] < text_len[:, None])[:, None, None, :]  # (B, 1, 1, text)
        self.frame_mask = index.valid[:, None, None, :]  # (B, 1, 1, frames)
        self.motion_mask = self.frame_mask.repeat_interleave(t, dim=0)  # (B*T, 1, 1, frames)

    def _write(
        self, kb: torch.Tensor, vb: torch.Tensor, k: torch.Tensor, v: torch.Tensor, put: tuple
    ) -> None:
        kb.index_put_(put, k.to(kb.dtype))
        vb.index_put_(put, v.to(vb.dtype))

    def _sorted(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.order is None else x.index_select(0, self.order)

    def _unsorted(self, outs: list[torch.Tensor]) -> torch.Tensor:
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return o if self.unorder is None else o.index_select(0, self.unorder)

    def _in_place(
        self,
        q: torch.Tensor,
        kb: torch.Tensor,
        vb: torch.Tensor,
        spans: list[int],
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """q (B, L, heads, hd) over kb, vb (rows + 1, slots, heads, hd): per run one SDPA over the
        view of its rows cut at its span; never a copy of K/V."""
        q = self._sorted(q)
        out = []
        for r, span, mask in zip(self.runs, spans, masks, strict=True):
            kk, vv = kb[r.row : r.row + r.size, :span], vb[r.row : r.row + r.size, :span]
            out.append(sdpa(q[r.first : r.first + r.size], kk.to(q.dtype), vv.to(q.dtype), mask))
        return self._unsorted(out)

    def self_attn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (B, L, heads, hd) post-RoPE -> (B, L, heads, hd)."""
        kb, vb = self.pool.k[layer], self.pool.v[layer]
        self._write(kb, vb, k, v, self._put)
        if self.gather:
            rows = self.index.rows
            kk, vv = kb.index_select(0, rows), vb.index_select(0, rows)
            return sdpa(q, kk.to(q.dtype), vv.to(q.dtype), self.self_mask)
        t = self.tokens_per_frame
        return self._in_place(q, kb, vb, [r.span * t for r in self.runs], self.token_masks)

    def cross_attn(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (B, L, heads, hd) over each entry's text K/V."""
        kb, vb = self.pool.tk[layer], self.pool.tv[layer]
        if self.gather:
            rows = self.index.rows
            kk, vv = kb.index_select(0, rows).to(q.dtype), vb.index_select(0, rows).to(q.dtype)
            return sdpa(q, kk, vv, self.text_mask)
        return self._in_place(q, kb, vb, self.text_spans, self.text_masks)

    def one_text_value(self, layer: int) -> torch.Tensor | None:
        """Each entry's text V (B, 1, heads, hd) when the rows hold one text token, else None:
        softmax over one key weighs it 1, so `cross_attn` of any query is that V."""
        if self.pool.text_tokens != 1:
            return None
        tv = self.pool.tv[layer]
        if self.gather:
            return tv.index_select(0, self.index.rows)
        # a view per run (the attention's output itself, one token a row)
        return self._unsorted([tv[r.row : r.row + r.size] for r in self.runs])

    def motion_attn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Temporal attention along frames at every spatial position: q, k, v (B, n*T, heads, hd)."""
        b, nt, heads, hd = q.shape
        t, f = self.tokens_per_frame, self.frame_slots
        n = nt // t
        kb, vb = self.pool.ak[layer], self.pool.av[layer]  # position-major rows
        self._write(kb, vb, k, v, self._put_motion)
        if self.gather:
            rows = self.index.rows
            kk = (
                kb.index_select(0, rows).flatten(0, 1).unflatten(0, (-1, f)).to(q.dtype)
            )  # (B*T, F, heads, hd)
            vv = vb.index_select(0, rows).flatten(0, 1).unflatten(0, (-1, f)).to(q.dtype)
            o = sdpa(_frames_major(q, t), kk, vv, self.motion_mask)
        else:
            qs = _frames_major(self._sorted(q), t)  # (B*T, n, heads, hd) in row order
            out = []
            for r in self.runs:
                # (size*T, span, heads, hd) views: each of its rows' positions along its frame slots
                kk = kb[r.row : r.row + r.size].unflatten(1, (t, f))[:, :, : r.span].flatten(0, 1)
                vv = vb[r.row : r.row + r.size].unflatten(1, (t, f))[:, :, : r.span].flatten(0, 1)
                mask = None if r.mask is None else r.mask.repeat_interleave(t, dim=0)  # (size*T, 1, 1, span)
                out.append(
                    sdpa(qs[r.first * t : (r.first + r.size) * t], kk.to(q.dtype), vv.to(q.dtype), mask)
                )
            o = self._unsorted([o.unflatten(0, (-1, t)) for o in out]).flatten(0, 1)
        return o.unflatten(0, (b, t)).transpose(1, 2).reshape(b, n * t, heads * hd)

    def frame_attn(
        self, kb: torch.Tensor, vb: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Every token of an entry attends to one K/V token per attended frame of its row: q
        (B, n*T, heads, hd); k, v (B, n, heads, hd) of the chunk's frames, written into the
        per-frame buffers kb, vb (rows + 1, frames, heads, hd). Returns (B, n*T, heads * hd)."""
        self._write(kb, vb, k, v, self._put_frames)
        if self.gather:
            rows = self.index.rows
            kk, vv = kb.index_select(0, rows).to(q.dtype), vb.index_select(0, rows).to(q.dtype)
            return sdpa(q, kk, vv, self.frame_mask).flatten(2)
        return self._in_place(q, kb, vb, [r.span for r in self.runs], [r.mask for r in self.runs]).flatten(2)


class DenseAttention:
    """The whole-clip forward's attention (training and the reference): a frame-level mask."""

    def __init__(
        self,
        frame_mask: torch.Tensor,
        tokens_per_frame: int,
        text_k: list[torch.Tensor],
        text_v: list[torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        motion_rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        t = tokens_per_frame
        self.frame_mask = frame_mask  # (F, F) bool
        self.token_mask = frame_mask.repeat_interleave(t, 0).repeat_interleave(t, 1)
        self.tokens_per_frame = t
        self.text_k, self.text_v = text_k, text_v  # per layer (B, L_text, heads, hd)
        self.rope = rope
        self.motion_rope = motion_rope

    def self_attn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Block-causal attention over the clip."""
        return sdpa(q, k, v, self.token_mask)

    def cross_attn(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention to the text tokens."""
        return sdpa(q, self.text_k[layer].to(q.dtype), self.text_v[layer].to(q.dtype))

    def one_text_value(self, layer: int) -> torch.Tensor | None:
        """The text V (B, 1, heads, hd) when the text is one token, else None (`PoolAttention`'s)."""
        v = self.text_v[layer]
        return v if v.shape[1] == 1 else None

    def motion_attn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Temporal attention along frames under the frame mask."""
        b, nt, heads, hd = q.shape
        t = self.tokens_per_frame
        o = sdpa(_frames_major(q, t), _frames_major(k, t), _frames_major(v, t), self.frame_mask)
        return o.unflatten(0, (b, t)).transpose(1, 2).reshape(b, nt, heads * hd)

    def frame_attn(
        self,
        kb: torch.Tensor | None,
        vb: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Tokens attend to one K/V token per frame (B, F, heads, hd) under the frame mask (no buffers)."""
        mask = self.frame_mask.repeat_interleave(self.tokens_per_frame, dim=0)  # (F*T, F)
        return sdpa(q, k, v, mask).flatten(2)
