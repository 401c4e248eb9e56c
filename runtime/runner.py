"""The runner owns the device: worlds, per-stream state, and the chunk loop of each transaction.

`execute(plan)` runs one batch (sessions that share a model and a chunk shape) through:

    denoise:0 .. denoise:K-1   K few-step denoising forwards (cancel checked before each)
    context                    the clean pass writes the chunk's K/V into scratch slots
    decode                     latents -> frames with a private decoder cache
    commit                     last cancel check; the transaction is staged for the engine

A cancelled session leaves the batch at the boundary and is rolled back; the others go on.
An exception inside the model rolls back every open transaction of the batch; the batch is then
retried one session at a time so that only the session that really fails gets a `ChunkFailed`.
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
from models.sampler import add_noise
from models.world import World
from runtime.kv_cache import KVLayout
from runtime.plan import ScheduledChunk, StepPlan
from runtime.requests import ChunkTimings
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
    return any(marker in text for marker in ("CUDA error", "device-side assert", "illegal memory access"))


class Runner:
    """Executes step plans against the worlds it owns."""

    def __init__(
        self,
        worlds: dict[str, World],
        is_aborted: Callable[[int], bool],
        boundary_hook: BoundaryHook | None = None,
    ) -> None:
        self.worlds = worlds
        self.is_aborted = is_aborted
        self.boundary_hook = boundary_hook
        self.streams: dict[str, Stream] = {}
        self.layouts = {
            name: KVLayout(w.transformer.cfg.sink_frames, w.transformer.cfg.window_frames, w.tokens_per_frame)
            for name, w in worlds.items()
        }

    # -- execution ------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run the plan's batch."""
        out = RunnerOutput()
        if plan.chunks:
            self._run_batch(plan.model_id, plan.chunks, out, split_on_error=True)
        return out

    def _begin(self, sc: ScheduledChunk, world: World, out: RunnerOutput) -> Transaction | None:
        """Open the chunk's transaction and read its actions; a failing action source fails only
        this chunk (reported in `out`), never the engine."""
        stream = self.streams[sc.stream_id]
        txn = Transaction(stream, sc.request, [])
        req = sc.request
        n_video = world.layout.video_frames(stream.state.frames, sc.n_latent)
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
            out.failed.append((txn, f"reading actions failed: {type(exc).__name__}: {exc}"))
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
            noise = world.noise(st.seed, 0, len(world.config.schedule.steps), n)[None]
        slots = [self.layouts[stream.model_id].slots(0, n, world.device)]
        world.context(x0, [st], slots, acts, noise=noise)
        frames, cache = world.decode(x0[0], st)
        frames = frames.cpu().numpy()
        st.frames += n
        st.video_frames += frames.shape[0]
        st.decoder = cache
        st.start_latents = None
        return frames[-1]

    def _run_batch(
        self, model_id: str, chunks: list[ScheduledChunk], out: RunnerOutput, split_on_error: bool
    ) -> None:
        world = self.worlds[model_id]
        opened = [(sc, self._begin(sc, world, out)) for sc in chunks]
        chunks = [sc for sc, t in opened if t is not None]
        txns = [t for _, t in opened if t is not None]
        if not txns:
            return
        try:
            self._transact(world, self.layouts[model_id], chunks[0], txns, out)
        except Exception as exc:
            if is_fatal(exc):
                raise
            still_open = [(sc, t) for sc, t in zip(chunks, txns, strict=True) if t.status is TxnStatus.OPEN]
            for _, t in still_open:
                t.rollback()
            culprit = exc.stream_id if isinstance(exc, InjectedFault) else None
            if culprit is None and (len(still_open) == 1 or not split_on_error):
                log.exception("chunk failed for %s", [t.stream.stream_id for _, t in still_open])
                out.failed.extend((t, f"{type(exc).__name__}: {exc}") for _, t in still_open)
                return
            retry = []
            for sc, t in still_open:
                if t.stream.stream_id == culprit:
                    out.failed.append((t, str(exc)))
                else:
                    retry.append(sc)
            # Re-run the innocent one by one, so a real (non-injected) failure lands on its owner.
            for sc in retry:
                self._run_batch(model_id, [sc], out, split_on_error=False)

    def _boundary(self, name: str, txns: list[Transaction], out: RunnerOutput) -> list[int]:
        """Run hooks, drop aborted transactions; returns the indices (into txns) still active."""
        if name.startswith("denoise:"):
            delay = max(t.stream.debug.step_delay_ms for t in txns)
            if delay > 0:
                time.sleep(delay / 1000)
        if self.boundary_hook is not None:
            for t in txns:
                self.boundary_hook(t.stream.stream_id, name)
        keep = []
        for i, t in enumerate(txns):
            if self.is_aborted(t.request.request_id):
                t.rollback()
                out.cancelled.append(t)
            else:
                keep.append(i)
        return keep

    def _transact(
        self,
        world: World,
        layout: KVLayout,
        first: ScheduledChunk,
        txns: list[Transaction],
        out: RunnerOutput,
    ) -> None:
        sync = torch.cuda.synchronize if world.device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        n = first.n_latent
        slots = [layout.slots(t.latent_start, n, world.device) for t in txns]
        acts = None
        if world.transformer.cfg.action is not None:
            groups = [
                group_actions(world.action_space, world.layout, t.latent_start, n, t.actions) for t in txns
            ]
            acts = torch.stack([g.tensor for g in groups])
        sched = world.config.schedule

        def narrow(keep: list[int], *tensors: torch.Tensor | None):
            nonlocal txns, slots
            txns = [txns[i] for i in keep]
            slots = [slots[i] for i in keep]
            idx = torch.tensor(keep, device=world.device)
            return [None if x is None else x.index_select(0, idx) for x in tensors]

        x = torch.stack([world.noise(t.stream.state.seed, t.chunk, 0, n) for t in txns])
        sigmas, steps = sched.sigmas, sched.timesteps
        for k, (tk, sg) in enumerate(zip(steps, sigmas, strict=True)):
            keep = self._boundary(f"denoise:{k}", txns, out)
            if len(keep) < len(txns):
                x, acts = narrow(keep, x, acts)
            if not txns:
                return
            armed = [t for t in txns if t.stream.debug.fail_at_chunk == t.chunk and not t.stream.fault_fired]
            with _injected_fault(world, armed[0] if armed and k == 0 else None):
                pred = world.denoise(x, tk, [t.stream.state for t in txns], slots, acts)
            x0 = sched.to_x0(pred, x, sg)
            if k + 1 < len(steps):
                nz = torch.stack([world.noise(t.stream.state.seed, t.chunk, k + 1, n) for t in txns])
                x = add_noise(x0, nz, sigmas[k + 1])
        # read on the host with the frames (no sync here): a chunk whose latents are not finite
        # (an overflowing input, a diverging model) is rolled back instead of poisoning the world
        finite = torch.isfinite(x0).flatten(1).all(1)
        sync()
        t1 = time.perf_counter()

        keep = self._boundary("context", txns, out)
        if len(keep) < len(txns):
            x0, acts = narrow(keep, x0, acts)
        if not txns:
            return
        ctx_noise = None
        if world.config.context_noise > 0:
            ctx_noise = torch.stack(
                [world.noise(t.stream.state.seed, t.chunk, len(sched.steps), n) for t in txns]
            )
        world.context(x0, [t.stream.state for t in txns], slots, acts, noise=ctx_noise)
        sync()
        t2 = time.perf_counter()

        keep = self._boundary("decode", txns, out)
        if len(keep) < len(txns):
            x0, finite = narrow(keep, x0, finite)
        ok = finite.tolist()
        for t, good in zip(txns, ok, strict=True):
            if not good:
                t.rollback()
                out.failed.append((t, "the model produced non-finite latents"))
        if not all(ok):
            (x0,) = narrow([i for i, good in enumerate(ok) if good], x0)
        decoded = []
        for i, t in enumerate(txns):
            frames, cache = world.decode(x0[i], t.stream.state)
            decoded.append((frames.cpu().numpy(), cache))
        t3 = time.perf_counter()

        keep = set(self._boundary("commit", txns, out))
        for i, t in enumerate(txns):
            if i not in keep:
                continue
            frames, cache = decoded[i]
            queue_ms = (t0 - t.request.submitted_at) * 1000 if t.request.submitted_at else 0.0
            timings = ChunkTimings(
                queue=queue_ms,
                denoise=(t1 - t0) * 1000,
                context=(t2 - t1) * 1000,
                decode=(t3 - t2) * 1000,
                total=(time.perf_counter() - t0) * 1000,
            )
            t.stage(Staged(n_latent=n, decoder=cache, frames=frames, timings=timings))
            out.staged.append(t)
