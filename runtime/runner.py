"""The runner owns the device side of streams: their world state (one K/V pool row each) and the
chunk transaction of every batch.

A step's batch (sessions that share a model and a chunk shape) is one `Batch`, one batched call
per stage for every session in it:

    denoise:0 .. denoise:K-1   K few-step denoising forwards (cancel checked before each)
    context                    the clean pass writes each chunk's K/V into its scratch slots
    decode                     latents -> frames, batched across sessions, private decoder caches
    commit                     last cancel check; the transactions are staged for the engine

The engine calls `execute(plan)` (denoise + context), commits what it returns, then `decode()`.

Serial (the default off CUDA), the clean pass is *owed*: `decode()` runs the decode and stages
the chunks right after the denoise, they commit in the same step, and their clean pass runs at
the start of the next `execute`, which the engine calls at once when it has nothing else to do
(`busy`). The frames go out a clean pass earlier; the K/V is written while the client receives
them, before anything reads it (a next chunk, a fork, a reset; `Engine._settle`). A committed
chunk cannot be cancelled, so the owed pass has no boundary; should it fail, the chunks are
tried again alone and a stream whose pass fails alone is *lost* (`Stream.lost`): its later
chunks fail with that message until it is reset.

Pipelined (`pipeline=True`, the CUDA default), the decode runs on a side CUDA stream and the
next step's `execute` first computes the next batch, then waits for these frames: chunk k's
decode overlaps chunk k+1's denoise. Chunk k+1 of a stream may then run on top of chunk k's
uncommitted K/V (`Transaction.after`; the K/V ring keeps a chunk of slack for it,
runtime/kv_cache.py). Frames are still released only at commit; if chunk k does not commit, chunk
k+1 is rolled back and goes back to the head of its stream's queue: it runs again on the
committed world in a later batch, as if it had waited.

A cancelled session leaves the batch at a boundary and is rolled back; its entry turns into
padding (it points at the pool's padding row), so the others go on with the same shapes. An
exception inside the model rolls back every open transaction of the batch; the chunks then run
again one at a time so that only the session that really fails gets a `ChunkFailed`.

Nothing in a chunk waits for the device: the index tensors go up once per step (pinned, non-
blocking on CUDA), stage times are CUDA events read after the batch's one device->host copy of
the frames, and noise is drawn on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from models.actions import FrameAction, group_actions
from models.kv_pool import ChunkIndex
from models.plugin import PluginState
from models.world import Conditioning, World
from runtime.kv_cache import KVLayout
from runtime.plan import ScheduledChunk, StepPlan
from runtime.requests import ChunkTimings, DebugHooks
from runtime.transaction import Staged, Stream, Transaction, TxnStatus

log = logging.getLogger(__name__)

# (stream_id, boundary name) -> None; runs at every boundary before the cancel check (tests, hooks).
BoundaryHook = Callable[[str, str], None]


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
        self.size = world.bucket(len(txns)) or len(txns)
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
        rows = [t.stream.state.row if i in live else None for i, t in enumerate(self.txns)]
        starts = [t.latent_start for t in self.txns]
        w = self.world
        return self.layout.index(rows, starts, self.n, w.pad_row, self.size, w.device)

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
            frames, self.caches = self.world.decode_batch([self.x0[i] for i in self.live], states)
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


class Runner:
    """Owns the streams' device state and executes step plans against the worlds."""

    def __init__(
        self,
        worlds: dict[str, World],
        is_aborted: Callable[[int], bool],
        boundary_hook: BoundaryHook | None = None,
        pipeline: bool = False,
        defer_context: bool | None = None,
    ) -> None:
        """`defer_context`: run each chunk's clean pass after its commit (see the module's
        docstring); None (the default) defers when not pipelined. A pipelined chunk runs on
        top of its predecessor's clean pass, so the two do not combine."""
        if pipeline and defer_context:
            raise ValueError("a pipelined runner cannot defer the clean pass")
        self.worlds = worlds
        self.is_aborted = is_aborted
        self.boundary_hook = boundary_hook
        self.pipeline = pipeline
        self.defer_context = not pipeline if defer_context is None else defer_context
        self.streams: dict[str, Stream] = {}
        for name, w in worlds.items():
            if pipeline and w.slack_frames < w.chunk_frames:
                raise ValueError(f"{name}: pipelined, world.setup needs slack_frames={w.chunk_frames}")
        self.layouts = {
            name: KVLayout(cfg.sink_frames, cfg.window_frames, w.tokens_per_frame, w.slack_frames)
            for name, w in worlds.items()
            for cfg in [w.transformer.cfg]
        }
        self.out = RunnerOutput()
        self.decoding: Batch | None = None  # pipelined: the batch whose decode is in flight
        self.owed: list[Batch] = []  # deferred: committed batches whose clean pass has not run
        self._computed: Batch | None = None  # computed by `execute`, decoded by `decode`
        self._again: list[tuple[str, ScheduledChunk]] = []  # (model, chunk) to re-run alone in `decode`
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    # -- stream ownership -----------------------------------------------------------------------

    def add(self, stream_id: str, model_id: str, cond: Conditioning, debug: DebugHooks) -> np.ndarray | None:
        """A new stream with a fresh, prefilled world (takes a pool row); returns its start frame
        (see `prefill`). On error nothing is kept."""
        if stream_id in self.streams:
            raise ValueError(f"stream {stream_id} exists")
        state = self.worlds[model_id].init_state(cond)
        self.streams[stream_id] = Stream(stream_id, model_id, state, debug)
        try:
            return self.prefill(stream_id)
        except Exception:
            self.remove(stream_id)
            raise

    def fork(self, src_id: str, dst_id: str) -> Stream:
        """A new stream holding a copy of `src_id`'s committed world (copies its pool row)."""
        src = self.streams[src_id]
        state = self.worlds[src.model_id].fork_state(src.state)
        dst = Stream(dst_id, src.model_id, state, src.debug, action_log=src.action_log.copy())
        dst.fault_fired = src.fault_fired
        self.streams[dst_id] = dst
        return dst

    def reset(self, stream_id: str, cond: Conditioning) -> np.ndarray | None:
        """A fresh, prefilled world in the same stream; returns its start frame (see `prefill`).
        If the new world cannot be built the old one stays and the error is raised."""
        stream = self.streams[stream_id]
        world = self.worlds[stream.model_id]
        old = stream.state
        stream.state = world.init_state(cond)
        try:
            frame = self.prefill(stream_id)
        except Exception:
            world.release_state(stream.state)
            stream.state = old
            raise
        world.release_state(old)
        stream.action_log.clear()
        stream.fault_fired = False
        stream.lost = None
        return frame

    def remove(self, stream_id: str) -> None:
        """Forget a stream and free its pool row (no-op when absent)."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self.worlds[stream.model_id].release_state(stream.state)

    # -- execution ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a batch's decode is in flight or a clean pass is owed (the next `execute`
        finishes them)."""
        return self.decoding is not None or bool(self.owed)

    def in_flight(self, stream_id: str) -> int:
        """Chunks of the stream past their clean pass and not yet committed (0 or 1)."""
        b = self.decoding
        return int(b is not None and any(b.txns[i].stream.stream_id == stream_id for i in b.live))

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """The first half of a step: the clean passes owed by chunks committed before (serial),
        then the plan's denoise and, unless owed, context passes (a chunk runs on top of its
        stream's chunk still decoding, if any); then, pipelined, wait for the previous batch's
        frames and stage its chunks. The engine commits the output, then calls `decode`."""
        self.out = RunnerOutput()
        paid = self._pay()
        if plan.chunks:
            self._computed = self._compute(plan.model_id, plan.chunks, paid)
        prev, self.decoding = self.decoding, None
        if prev is not None:
            self._guard(prev, prev.finish)
        return self.out

    def decode(self) -> RunnerOutput:
        """The second half, after the engine committed `execute`'s output: chunks that lost the
        chunk they ran on top of go back to the engine (`requeue`: they run in a later step, as
        if they had waited); the computed batch's decode starts (serial: and finishes); then the
        innocent mates of a failed batch run again alone on the committed world."""
        self.out = RunnerOutput()
        batch, self._computed = self._computed, None
        if batch is not None:
            self.out.requeue += batch.drop_orphans()
            if batch.live and self._guard(batch, batch.decode) and batch.live:
                if self.pipeline:
                    self.decoding = batch
                else:
                    self._guard(batch, batch.finish)
                    self._owe(batch)
        while self._again:
            model, sc = self._again.pop(0)
            self._run_alone(model, sc)
        return self.out

    def _owe(self, batch: Batch) -> None:
        """Deferred: the staged entries' clean pass runs at the next `execute` (after commit)."""
        if self.defer_context and batch.live:
            self.owed.append(batch)

    def _pay(self) -> StageClock | None:
        """Run the owed clean passes; returns their clock (None when none was owed). A batch
        whose pass fails runs it again one entry at a time; a stream whose pass fails alone is
        lost (`Stream.lost`)."""
        owed, self.owed = self.owed, []
        if not owed:
            return None
        clock = StageClock(owed[0].world.device)
        clock.mark("pay")
        for batch in owed:
            if self._settle(batch, None) is not None:
                log.warning("clean pass failed; running it again per stream")
                for i in list(batch.live):
                    if (exc := self._settle(batch, [i])) is not None:
                        stream = batch.txns[i].stream
                        why = f"{type(exc).__name__}: {exc}"
                        stream.lost = f"its world was lost (the clean pass failed: {why}); reset it"
        clock.mark("paid")
        return clock

    def _settle(self, batch: Batch, entries: list[int] | None) -> Exception | None:
        """`Batch.settle`; returns its non-fatal error (logged) instead of raising it."""
        try:
            batch.settle(entries)
        except Exception as exc:
            if is_fatal(exc):
                raise
            log.exception("clean pass failed for %s", [batch.txns[i].stream.stream_id for i in batch.live])
            return exc
        return None

    @contextlib.contextmanager
    def decode_stream(self, device: torch.device, inputs: tuple[torch.Tensor, ...]) -> Iterator[None]:
        """Pipelined on CUDA: run the block on this device's side stream after the work queued so
        far (the inputs are marked as used there); otherwise on the current stream."""
        if not self.pipeline or device.type != "cuda":
            yield
            return
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        for t in inputs:
            t.record_stream(side)
        with torch.cuda.stream(side):
            yield

    def _begin(self, sc: ScheduledChunk, world: World) -> Transaction | None:
        """Open the chunk's transaction (on top of the stream's chunk still decoding, if any) and
        read its actions; a failing action source fails only this chunk (reported in `out`),
        never the engine."""
        stream = self.streams[sc.stream_id]
        if stream.lost is not None:
            txn = Transaction(stream, sc.request, [], n_latent=sc.n_latent)
            txn.rollback()
            self.out.failed.append((txn, stream.lost))
            return None
        b = self.decoding
        after = next((b.txns[i] for i in b.live if b.txns[i].stream is stream), None) if b else None
        txn = Transaction(stream, sc.request, [], after=after, n_latent=sc.n_latent)
        req = sc.request
        n_video = world.layout.video_frames(txn.latent_start, sc.n_latent)
        try:
            if req.source is not None:
                txn.actions = req.source.take(n_video)
            elif not req.actions:
                txn.actions = [FrameAction.idle()] * n_video
            elif len(req.actions) == 1:
                txn.actions = list(req.actions) * n_video
            else:
                txn.actions = list(req.actions)
        except Exception as exc:
            log.exception("action source of %s failed", sc.stream_id)
            txn.rollback()
            self.out.failed.append((txn, f"reading actions failed: {type(exc).__name__}: {exc}"))
            return None
        return txn

    @torch.no_grad()
    def prefill(self, stream_id: str) -> np.ndarray | None:
        """Write an image-started world's start image into its cache as committed frame 0.

        Runs when the stream is created or reset (not as a chunk: chunk 1 is the first generated
        chunk). Returns the start frame (H, W, 3) uint8, or None for worlds without one. On error
        nothing is committed and the caller drops the stream."""
        stream = self.streams[stream_id]
        st = stream.state
        if st.start_latents is None:
            return None
        world = self.worlds[stream.model_id]
        x0 = st.start_latents[None]  # (1, C, n, h, w)
        n = x0.shape[2]
        acts = None
        if world.transformer.cfg.action is not None:
            idle = [FrameAction.idle()] * world.layout.video_frames(0, n)
            acts = group_actions(world.action_space, world.layout, 0, n, idle).tensor[None]
        noise = None
        if world.config.context_noise > 0:  # chunk 0: a key no generated chunk uses
            noise = world.noise_batch([(st.seed, 0, len(world.config.schedule.steps))], n)
        index = self.layouts[stream.model_id].index([st.row], [0], n, world.pad_row, device=world.device)
        world.context(x0, index, acts, noise=noise)
        frames, cache = world.decode(x0[0], st)
        frames = frames.cpu().numpy()
        st.frames += n
        st.video_frames += frames.shape[0]
        st.decoder = cache
        st.start_latents = None
        if world.plugin is not None:
            st.plugin_state = world.plugin.start(x0[0])
        return frames[-1]

    def _compute(
        self, model_id: str, chunks: list[ScheduledChunk], paid: StageClock | None = None
    ) -> Batch | None:
        """Open the chunks' transactions and run denoise + context as one batch; None when nobody
        is left. On a model error the batch is rolled back (see `_recover`). `paid`: the owed
        clean passes this step ran first (`_pay`)."""
        world = self.worlds[model_id]
        opened = [(sc, self._begin(sc, world)) for sc in chunks]
        chunks = [sc for sc, t in opened if t is not None]
        txns = [t for _, t in opened if t is not None]
        if not txns:
            return None
        batch = Batch(self, model_id, chunks, txns, paid)
        if not self._guard(batch, batch.compute):
            return None
        return batch if batch.live else None

    def _guard(self, batch: Batch, stage: Callable[[], object]) -> bool:
        """Run a stage; a non-fatal error rolls the batch back (`_recover`) and returns False."""
        try:
            stage()
        except Exception as exc:
            if is_fatal(exc):
                raise
            self._recover(batch, exc)
            return False
        return True

    def _run_alone(self, model_id: str, sc: ScheduledChunk) -> None:
        """One chunk on the committed world, start to staged (a retry: its error is its own)."""
        txn = self._begin(sc, self.worlds[model_id])
        if txn is None:
            return
        batch = Batch(self, model_id, [sc], [txn])
        try:
            if batch.compute() and batch.decode():
                batch.finish()
                self._owe(batch)
        except Exception as exc:
            if is_fatal(exc):
                raise
            log.exception("chunk failed for %s", sc.stream_id)
            for t in batch.open_txns():
                t.rollback()
                self.out.failed.append((t, f"{type(exc).__name__}: {exc}"))

    def _recover(self, batch: Batch, exc: Exception) -> None:
        """Roll back every open transaction of the batch. An injected fault fails its own stream;
        a real error fails a lone chunk at once, and otherwise every chunk runs again alone (in
        `decode`, on the committed world) so that the error lands on its owner."""
        pairs = zip(batch.chunks, batch.txns, strict=True)
        still_open = [(sc, t) for sc, t in pairs if t.status is TxnStatus.OPEN]
        for _, t in still_open:
            t.rollback()
        batch.live = []
        culprit = exc.stream_id if isinstance(exc, InjectedFault) else None
        if culprit is None and len(still_open) == 1:
            log.exception("chunk failed for %s", still_open[0][1].stream.stream_id)
            self.out.failed.append((still_open[0][1], f"{type(exc).__name__}: {exc}"))
            return
        for sc, t in still_open:
            if t.stream.stream_id == culprit:
                self.out.failed.append((t, str(exc)))
            else:
                self._again.append((batch.model_id, sc))
