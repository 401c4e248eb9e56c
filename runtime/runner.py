"""The runner owns the device side of streams (their world state, one K/V pool row each) and the
policy of running batches: when each stage of a `Batch` (runtime/batch.py: denoise, clean pass,
decode, finish) runs, what overlaps what, and what happens when the model raises.

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

A cancelled session leaves the batch at a boundary and is rolled back (runtime/batch.py). An
exception inside the model rolls back every open transaction of the batch; the chunks then run
again one at a time so that only the session that really fails gets a `ChunkFailed`.

Nothing in a chunk waits for the device: the index tensors go up once per step (pinned, non-
blocking on CUDA), stage times are CUDA events read after the batch's one device->host copy of
the frames, and noise is drawn on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from models.actions import FrameAction, group_actions
from models.world import Conditioning, ModelError, PreparedConditioning, World
from runtime.batch import Batch, InjectedFault, RunnerOutput, StageClock, is_fatal
from runtime.errors import NotRetained
from runtime.history import Checkpoint, ChunkHistory
from runtime.kv_cache import KVLayout
from runtime.plan import ScheduledChunk, StepPlan
from runtime.requests import DebugHooks
from runtime.transaction import PromptSwitch, Stream, Transaction, TxnStatus

log = logging.getLogger(__name__)

# (stream_id, boundary name) -> None; runs at every boundary before the cancel check (tests, hooks).
BoundaryHook = Callable[[str, str], None]


def ring_slack(chunk_frames: int, pipeline: bool, retention: int) -> int:
    """Ring slots per pool row beyond the window (runtime/kv_cache.py): a chunk's worth when
    pipelined (a second chunk in flight), plus `retention` chunks' worth (runtime/history.py)."""
    return chunk_frames * (int(pipeline) + retention)


class Runner:
    """Owns the streams' device state and executes step plans against the worlds."""

    def __init__(
        self,
        worlds: dict[str, World],
        is_aborted: Callable[[int], bool],
        boundary_hook: BoundaryHook | None = None,
        pipeline: bool = False,
        defer_context: bool | None = None,
        retention: int = 0,
        fixed_batch: int | None = None,
    ) -> None:
        """`fixed_batch`: deterministic serving, every batch padded to this size and each entry
        attending and decoding on its own (runtime/batch.py; None: batches as they come).
        `defer_context`: run each chunk's clean pass after its commit (see the module's
        docstring); None (the default) defers when not pipelined. A pipelined chunk runs on
        top of its predecessor's clean pass, so the two do not combine. `retention`: chunks a
        stream can be rewound by (`rewind`; the worlds' rings have that many chunks of extra
        slack, runtime/history.py)."""
        if pipeline and defer_context:
            raise ValueError("a pipelined runner cannot defer the clean pass")
        self.worlds = worlds
        self.is_aborted = is_aborted
        self.boundary_hook = boundary_hook
        self.pipeline = pipeline
        self.defer_context = not pipeline if defer_context is None else defer_context
        self.streams: dict[str, Stream] = {}
        self.retention = retention
        self.fixed_batch = fixed_batch
        for name, w in worlds.items():
            need = ring_slack(w.chunk_frames, pipeline, retention)
            if w.slack_frames < need:
                raise ValueError(f"{name}: world.setup needs slack_frames={need}")
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
        self._no_row: list[ScheduledChunk] = []  # prompt switches that found no free row: run later
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    # -- stream ownership -----------------------------------------------------------------------

    def add(
        self,
        stream_id: str,
        model_id: str,
        cond: Conditioning,
        debug: DebugHooks,
        prepared: PreparedConditioning | None = None,
    ) -> np.ndarray | None:
        """A new stream with a fresh, prefilled world (takes a pool row); returns its start frame
        (see `prefill`). `prepared`: its conditioning computed before (`World.prepare`; None:
        computed here). On error nothing is kept."""
        if stream_id in self.streams:
            raise ValueError(f"stream {stream_id} exists")
        state = self.worlds[model_id].init_state(cond, prepared)
        stream = Stream(stream_id, model_id, state, debug, history=ChunkHistory(self.retention))
        self.streams[stream_id] = stream
        try:
            frame = self.prefill(stream_id)
        except Exception:
            self.remove(stream_id)
            raise
        stream.history.record(state, frame)
        return frame

    def fork(self, src_id: str, dst_id: str) -> Stream:
        """A new stream holding a copy of `src_id`'s committed world (copies its pool row)."""
        src = self.streams[src_id]
        state = self.worlds[src.model_id].fork_state(src.state)
        dst = Stream(
            dst_id,
            src.model_id,
            state,
            src.debug,
            action_log=src.action_log.copy(),
            history=src.history.copy(),  # the copied row holds the same ring
        )
        dst.fault_fired = src.fault_fired
        self.streams[dst_id] = dst
        return dst

    def reset(
        self, stream_id: str, cond: Conditioning, prepared: PreparedConditioning | None = None
    ) -> np.ndarray | None:
        """A fresh, prefilled world in the same stream; returns its start frame (see `prefill`).
        `prepared`: as in `add`. If the new world cannot be built the old one stays and the
        error is raised."""
        stream = self.streams[stream_id]
        world = self.worlds[stream.model_id]
        old = stream.state
        stream.state = world.init_state(cond, prepared)
        try:
            frame = self.prefill(stream_id)
        except Exception:
            world.release_state(stream.state)
            stream.state = old
            raise
        world.release_state(old)
        stream.action_log.clear()
        stream.history.clear()
        stream.history.record(stream.state, frame)
        stream.fault_fired = False
        stream.lost = None
        return frame

    def checkpoint(self, stream_id: str, chunk: int) -> Checkpoint:
        """The retained position at the end of the stream's chunk `chunk`; `NotRetained` when the
        stream cannot go back there (beyond its retention, or not a committed chunk)."""
        stream = self.streams[stream_id]
        now = stream.state.chunks
        point = stream.history.get(chunk) if 0 <= chunk <= now else None
        if point is None:
            oldest = stream.history.oldest()
            oldest = now if oldest is None else oldest
            raise NotRetained(
                f"chunk {chunk} is not retained: this world can go back to its chunk {oldest} at "
                f"the earliest (it is at chunk {now}; retention {self.retention} chunks)",
                oldest,
            )
        return point

    def rewind(self, stream_id: str, chunk: int) -> np.ndarray | None:
        """Set a settled stream's committed world back to the end of its chunk `chunk` (nothing
        in flight: the engine settles first); returns that chunk's last frame (None: none). Only
        counters and references move: the ring still holds the K/V of the retained chunks
        (runtime/history.py). `NotRetained` when `chunk` is not among them; nothing changes then."""
        stream = self.streams[stream_id]
        st = stream.state
        point = self.checkpoint(stream_id, chunk)
        for _ in range(min(st.chunks - chunk, len(stream.action_log))):
            stream.action_log.pop()
        st.chunks, st.frames, st.video_frames = point.chunk, point.frames, point.video_frames
        st.decoder, st.plugin_state = point.decoder, point.plugin_state
        stream.history.truncate(chunk)
        # Slots past the committed length are masked, yet SDPA still multiplies their values:
        # a non-finite value a rolled-back chunk left there must not meet the next chunk.
        self.worlds[stream.model_id].scrub_state(st)
        return point.frame

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
        self.out.requeue += self._no_row
        self._no_row = []
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
        if req.prompt is not None and not self._switch(sc, txn, world):
            return None
        return txn

    def _switch(self, sc: ScheduledChunk, txn: Transaction, world: World) -> bool:
        """Stage the chunk's prompt switch in a pool row of its own (`PromptSwitch`): a copy of the
        row it would run on, the new text K/V, and with `prompt_switch` "recache" the K/V of the
        kept frames recomputed under the new prompt. False (the transaction rolled back): no row
        is free now (the chunk runs in a later step) or the switch failed (reported in `out`)."""
        assert sc.request.prompt is not None
        if world.free_rows == 0:
            txn.rollback()
            self._no_row.append(sc)
            return False
        try:
            row, lease = world.stage_prompt_row(txn.row, sc.request.prompt)
            txn.switch = PromptSwitch(sc.request.prompt, row, lease, world.free_row)
            if world.config.prompt_switch == "recache" and txn.latent_start > 0:
                world.recache(
                    self.layouts[txn.stream.model_id].recache_index(row, txn.latent_start, world.device)
                )
        except (ModelError, ValueError, RuntimeError) as exc:
            if is_fatal(exc):
                raise
            log.exception("prompt switch of %s failed", sc.stream_id)
            txn.rollback()
            self.out.failed.append((txn, f"prompt switch failed: {exc}"))
            return False
        return True

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
