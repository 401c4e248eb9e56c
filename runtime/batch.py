"""One batch: the stages a step runs for every chunk in it, one batched call per stage.

    denoise:0 .. denoise:K-1   K few-step denoising forwards (cancel checked before each)
    context                    the clean pass writes each chunk's K/V into its scratch slots
    decode                     latents -> frames, batched across sessions, private decoder caches
    finish                     last cancel check; the transactions are staged for the engine

A cancelled entry leaves the batch at a boundary and is rolled back; it turns into padding (it
points at the pool's padding row), so the others go on with the same shapes. When each stage
runs (serial with the clean pass owed, or pipelined on a side CUDA stream), and what happens when
the model raises, is the runner's policy (runtime/runner.py); the batch only runs its stages.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from models.actions import group_actions
from models.kv_pool import ChunkIndex
from models.plugin import PluginState
from models.world import World
from runtime.plan import ScheduledChunk
from runtime.requests import ChunkTimings
from runtime.transaction import Staged, Transaction, TxnStatus

if TYPE_CHECKING:
    from runtime.runner import Runner

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised inside the model by the `fail_at_chunk` debug hook."""

    def __init__(self, stream_id: str, chunk: int) -> None:
        super().__init__(f"injected fault in stream {stream_id} at chunk {chunk}")
        self.stream_id = stream_id


@dataclass
class RunnerOutput:
    """What one `execute` produced (host-side data only)."""

    staged: list[Transaction] = field(default_factory=list)  # ready to commit
    cancelled: list[Transaction] = field(default_factory=list)  # rolled back at a boundary
    failed: list[tuple[Transaction, str]] = field(default_factory=list)  # rolled back after a model error
    requeue: list[ScheduledChunk] = field(default_factory=list)  # rolled back, to run in a later step


@contextlib.contextmanager
def _injected_fault(world: World, txn: Transaction | None) -> Iterator[None]:
    """The `fail_at_chunk` debug hook: the model raises from inside its middle block (once)."""
    if txn is None:
        yield
        return
    txn.stream.fault_fired = True

    def hook(module: torch.nn.Module, args: tuple) -> None:
        raise InjectedFault(txn.stream.stream_id, txn.chunk)

    blocks = world.transformer.blocks
    handle = blocks[len(blocks) // 2].register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the device cannot be trusted (CUDA context lost): the engine dies."""
    text = str(exc)
    return any(sign in text for sign in ("CUDA error", "device-side assert", "illegal memory access"))


class StageClock:
    """Stage marks of one step: CUDA events on CUDA (read after the step's host copy, so reading
    them never waits), `perf_counter` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, torch.cuda.Event | float] = {}
        self.start = time.perf_counter()

    def mark(self, name: str) -> None:
        """Record the time at which the device reaches this point of the stream."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[name] = ev
        else:
            self.marks[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        """Milliseconds between two marks (0 when one was never reached)."""
        if a not in self.marks or b not in self.marks:
            return 0.0
        x, y = self.marks[a], self.marks[b]
        if self.cuda:
            return float(x.elapsed_time(y))  # type: ignore[union-attr]
        return (y - x) * 1000  # type: ignore[operator]


class HostCopy:
    """Tensors -> numpy arrays on the host in one copy, started now and read later: on CUDA a
    non-blocking copy into pinned memory on the current stream, read after its event."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.shapes = [t.shape for t in tensors]
        self.event: torch.cuda.Event | None = None
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
        if flat.device.type == "cuda":
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat

    def result(self) -> list[np.ndarray]:
        """The arrays (waits for the copy on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        buf = self.host.numpy()
        out, start = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape))
            out.append(buf[start : start + n].reshape(shape).copy())
            start += n
        return out


class Batch:
    """One step's chunk transactions on one world: one method per stage, each a batched call.

    Entries keep their batch position for the whole chunk; an entry that leaves (cancel) becomes
    padding, so every stage runs at the same batch size (a compiled bucket stays one graph).
    `compute` (denoise + context) and `decode` start work; `finish` waits for the frames and
    stages the survivors. Pipelined, the runner calls `finish` one step later, after the next
    batch's `compute`, so a decode overlaps the next denoise.
    """

    def __init__(
        self,
        runner: Runner,
        model_id: str,
        chunks: list[ScheduledChunk],
        txns: list[Transaction],
        paid: StageClock | None = None,
    ) -> None:
        self.runner = runner
        self.model_id = model_id
        self.world = world = runner.worlds[model_id]
        self.layout = runner.layouts[model_id]
        self.chunks = chunks  # what each entry serves (a retry re-runs it)
        self.txns = txns
        self.n = chunks[0].n_latent
        # Deterministic serving: one fixed batch size (padded) and each entry attending and
        # decoding on its own, so an entry's arithmetic never depends on its batch mates.
        self.size = world.bucket(runner.fixed_batch or len(txns)) or runner.fixed_batch or len(txns)
        self.live = list(range(len(txns)))  # entries still running
        self.clock = StageClock(world.device)
        self.paid = paid  # owed clean passes this step ran first (their time counts as this batch's context)
        self.index = self._index()
        self.states = self._states()
        # A world's plug-in picks the actions the DiT is conditioned on and what it pins in
        # every clean estimate (`WorldPlugin.plan`).
        actions = self._actions()
        plan = world.plugin.plan(actions, self.states) if self.states else None
        self.actions = plan.actions if plan is not None else actions
        self.pin = plan.pin if plan is not None else None
        self.x0 = torch.empty(0)  # the clean estimate, set by denoise
        self.finite = torch.empty(0)  # (size,) bool: x0 is finite, read with the frames
        self.caches: list = []  # decoder caches of the live entries, set by decode
        self.copy: HostCopy | None = None  # frames + finite flags on their way to the host

    def open_txns(self) -> list[Transaction]:
        """Transactions of this batch not yet staged or rolled back."""
        return [t for t in self.txns if t.status is TxnStatus.OPEN]

    # -- per-step tensors -----------------------------------------------------------------------

    def _index(self) -> ChunkIndex:
        live = set(self.live)
        rows = [t.row if i in live else None for i, t in enumerate(self.txns)]
        starts = [t.latent_start for t in self.txns]
        w = self.world
        separate = self.runner.fixed_batch is not None
        return self.layout.index(rows, starts, self.n, w.pad_row, self.size, w.device, separate)

    def _actions(self) -> torch.Tensor | None:
        w = self.world
        if w.transformer.cfg.action is None:
            return None
        groups = [
            group_actions(w.action_space, w.layout, t.latent_start, self.n, t.actions) for t in self.txns
        ]
        acts = torch.stack([g.tensor for g in groups])
        pad = self.size - acts.shape[0]
        if pad:
            acts = torch.cat([acts, acts.new_zeros(pad, *acts.shape[1:])])
        return acts.to(w.device, non_blocking=True)

    def _states(self) -> list[PluginState | None]:
        """Each entry's plug-in state: that of the chunk it runs on top of (pipelined) where that
        chunk made one, else its stream's committed one; empty for worlds without a plug-in."""
        if self.world.plugin is None:
            return []
        out = []
        for t in self.txns:
            staged = t.after.plugin_state if t.after is not None else None
            out.append(staged if staged is not None else t.stream.state.plugin_state)
        return out

    def _noise(self, step: int) -> torch.Tensor:
        """(size, C, n, h, w): each live entry's (seed, chunk, step) noise, zeros elsewhere, as the
        world's plug-in adjusts it (`WorldPlugin.noise`)."""
        live = set(self.live)
        keys = [(t.stream.state.seed, t.chunk, step) if i in live else None for i, t in enumerate(self.txns)]
        noise = self.world.noise_batch(keys + [None] * (self.size - len(keys)), self.n)
        plugin = self.world.plugin
        if plugin is not None and self.states:
            noise = plugin.noise(noise, [st if i in live else None for i, st in enumerate(self.states)])
        return noise

    # -- boundaries -----------------------------------------------------------------------------

    def boundary(self, name: str) -> bool:
        """Hooks, then cancelled entries roll back and turn into padding. False: nobody is left."""
        txns = [self.txns[i] for i in self.live]
        if name.startswith("denoise:"):
            delay = max(t.stream.debug.step_delay_ms for t in txns)
            if delay > 0:
                time.sleep(delay / 1000)
        if self.runner.boundary_hook is not None:
            for t in txns:
                self.runner.boundary_hook(t.stream.stream_id, name)
        keep = []
        for i in self.live:
            t = self.txns[i]
            if self.runner.is_aborted(t.request.request_id):
                t.rollback()
                self.runner.out.cancelled.append(t)
            else:
                keep.append(i)
        if len(keep) < len(self.live):
            self.live = keep
            if keep:
                self.index = self._index()
        return bool(keep)

    def drop_orphans(self) -> list[ScheduledChunk]:
        """Entries that ran on top of a chunk that did not commit leave the batch (rolled back);
        returns what they served, to run again on the committed world in a later step."""
        again = []
        for i in list(self.live):
            t = self.txns[i]
            if t.after is not None and t.after.status is not TxnStatus.COMMITTED:
                t.rollback()
                # Its K/V sit in slack slots the re-run will not overwrite before reading past
                # them; after a non-finite predecessor they are NaN.
                self.world.scrub_state(t.stream.state)
                again.append(self.chunks[i])
                self.live.remove(i)
            t.after = None  # settled: no chain of old transactions stays reachable
        return again

    # -- stages ---------------------------------------------------------------------------------

    def compute(self) -> bool:
        """Denoise, then the clean pass unless the runner owes it until after commit. False:
        nobody is left."""
        self.clock.mark("begin")
        return self.denoise() and (self.runner.defer_context or self.context())

    def denoise(self) -> bool:
        """K denoising forwards; leaves the clean estimate, in canonical form, in `x0`."""
        w = self.world
        sched = w.config.schedule
        x = self._noise(0)
        sigmas, steps = sched.sigmas, sched.timesteps
        for k, (tk, sg) in enumerate(zip(steps, sigmas, strict=True)):
            if not self.boundary(f"denoise:{k}"):
                return False
            armed = [
                self.txns[i]
                for i in self.live
                if self.txns[i].stream.debug.fail_at_chunk == self.txns[i].chunk
                and not self.txns[i].stream.fault_fired
            ]
            with _injected_fault(w, armed[0] if armed and k == 0 else None):
                pred = w.denoise(x, tk, self.index, self.actions)
            self.x0 = sched.to_x0(pred, x, sg)
            if self.pin is not None:
                self.x0 = self.pin(self.x0)
            if k + 1 < len(steps):
                x = sched.next_x(self.x0, x, sg, sigmas[k + 1], lambda k=k: self._noise(k + 1))
        # Read on the host with the frames (no sync here): a chunk whose latents are not finite
        # (an overflowing input, a diverging model) is rolled back instead of poisoning the world.
        self.finite = torch.isfinite(self.x0).flatten(1).all(1)
        raw = self.x0
        self.x0 = w.canonical(self.x0)  # what is shown is what the history keeps
        if w.plugin is not None:  # the plug-in states this chunk's commit installs
            for i, st in w.plugin.advance(raw, self.x0, self.states, self.live).items():
                self.txns[i].plugin_state = st
        self.clock.mark("denoised")
        return True

    def context(self) -> bool:
        """The clean pass: each chunk's K/V into its scratch slots."""
        if not self.boundary("context"):
            return False
        self._clean_pass()
        self.clock.mark("context")
        return True

    def settle(self, entries: list[int] | None = None) -> None:
        """The owed clean pass of the committed entries among `entries` (None: every live one;
        no boundary: a committed chunk cannot be cancelled); the others turn into padding."""
        live = [
            i
            for i in (self.live if entries is None else entries)
            if self.txns[i].status is TxnStatus.COMMITTED
        ]
        if live != self.live:
            self.live = live
            self.index = self._index()
        if live:
            self._clean_pass()

    def _clean_pass(self) -> None:
        w = self.world
        noise = self._noise(len(w.config.schedule.steps)) if w.config.context_noise > 0 else None
        w.context(self.x0, self.index, self.actions, noise=noise)

    def decode(self) -> bool:
        """Start latents -> frames for every live entry in one batched decode (on the runner's
        decode stream on CUDA) and their copy to the host. False: nobody is left."""
        if not self.boundary("decode"):
            return False
        with self.runner.decode_stream(self.world.device, (self.x0, self.finite)):
            states = [self.txns[i].stream.state for i in self.live]
            latents = [self.x0[i] for i in self.live]
            if self.runner.fixed_batch is None:
                frames, self.caches = self.world.decode_batch(latents, states)
            else:  # one decode per entry: the decoder's batch never depends on who is live
                each = [self.world.decode_batch([x], [s]) for x, s in zip(latents, states, strict=True)]
                frames = [f for fs, _ in each for f in fs]
                self.caches = [c for _, cs in each for c in cs]
            self.clock.mark("decoded")
            self.copy = HostCopy([*frames, self.finite.to(torch.uint8)])
        return True

    def finish(self) -> None:
        """Wait for the frames; roll back non-finite chunks; last cancel check; stage the rest."""
        assert self.copy is not None, "finish() before decode()"
        *host, finite = self.copy.result()
        ok = finite[self.live]
        decoded = {i: (f, c) for i, f, c in zip(self.live, host, self.caches, strict=True)}
        for i, good in zip(list(self.live), ok.tolist(), strict=True):
            if not good:
                t = self.txns[i]
                t.rollback()
                self.runner.out.failed.append((t, "the model produced non-finite latents"))
                self.live.remove(i)
        if not self.live or not self.boundary("commit"):
            return
        c, paid = self.clock, self.paid
        end = time.perf_counter()
        start = paid.start if paid is not None else c.start
        context = paid.ms("pay", "paid") if paid is not None else c.ms("denoised", "context")
        for i in self.live:
            t = self.txns[i]
            frames, cache = decoded[i]
            queue_ms = (start - t.request.submitted_at) * 1000 if t.request.submitted_at else 0.0
            timings = ChunkTimings(
                queue=queue_ms,
                denoise=c.ms("begin", "denoised"),
                context=context,
                decode=c.ms("context" if "context" in c.marks else "denoised", "decoded"),
                total=(end - start) * 1000,
            )
            t.stage(Staged(n_latent=self.n, decoder=cache, frames=frames, timings=timings))
            self.runner.out.staged.append(t)
