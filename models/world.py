"""The world-model contract: a causal DiT, a streaming decoder and a schedule, batched over sessions.

`World` implements the calls the runtime's chunk transaction is built from
(docs/ARCHITECTURE.md, "The world contract"):

* `prepare(cond)` -> `PreparedConditioning`: what a new world needs that no pool row holds yet (it
  may run on another thread);
* `init_state(cond, prepared)` -> `WorldState`: a row of the model's K/V pool, decoder cache, RNG key,
  counters;
* `denoise(x_t, t, index, actions)` -> prediction; reads committed K/V, writes scratch only;
* `canonical(x0)`: a generated chunk in the form it is shown and kept as history (the decoder's);
* `context(x0, index, actions)`: the clean pass that leaves the chunk's K/V in scratch;
* `decode(latents, state)` -> frames and a *new* decoder cache (the old one is untouched).

A world's own behaviour (what it does to a chunk's actions, noise and clean estimates, and the
per-session state that needs) is its optional `plugin` (`models.plugin.WorldPlugin`).

`denoise` and `context` run one batched forward over every entry of a `ChunkIndex` (built by the
runtime), optionally compiled with a fixed set of batch buckets. The K/V pool is static between
resizes: the runtime's memory owner (runtime/memory.py) sizes it (`resize`) and a state owns a row
until `release_state`, which frees it at once. Nothing here advances a counter:
committing is the runtime's job. No loop over sessions, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from models.actions import ActionSpace, FrameLayout
from models.causal_wan import CausalWan, TextKV
from models.kv_pool import ChunkIndex, motion_slots
from models.plugin import PluginState, WorldPlugin
from models.sampler import FlowSchedule, add_noise
from models.vae import DecoderCache, StreamingDecoder, cache_from_tensors, cache_to_tensors, decode_batch

if TYPE_CHECKING:
    from models.matrix_game.image import ImageConditioner  # an image-started family's conditioner


class ModelError(Exception):
    """Base of models/ errors.

    ModelError
     └── ConditioningError   bad seed image / prompt for this model (a client error)
    """


class ConditioningError(ModelError):
    """The conditioning does not fit this model; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelSpec:
    """What a client needs to know about a world (the protocol's `ready.model`)."""

    id: str  # registry name
    fps: float  # playback rate of the video frames
    width: int  # frame width in pixels
    height: int  # frame height in pixels
    chunk_frames: int  # video frames in a steady-state chunk
    action_space: ActionSpace  # inputs the model reads
    image_start: bool  # sessions start from an image (the seed's or the client's)
    description: str = ""
    prompts: bool = False  # sessions may send a text prompt (open/reset/generate `prompt`)


PROMPT_SWITCHES = ("plain", "recache")  # WorldConfig.prompt_switch values


@dataclass
class WorldConfig:
    """Serving settings of a world (stored as worldserve.json beside the weights)."""

    id: str  # registry name
    fps: float  # video frames per second for playback
    width: int  # video frame width, pixels
    height: int  # video frame height, pixels
    schedule: FlowSchedule = field(default_factory=FlowSchedule)  # noise levels per chunk
    context_noise: float = 0.0  # sigma of the history the context pass writes (0: clean)
    image_start: bool = (
        False  # starts from an image: prefilled as committed frame 0 (an I2V world: its conditioning)
    )
    description: str = ""
    text_prompts: bool = False  # sessions may bring a prompt (resolved by `World.prompts`)
    # At a prompt switch (text worlds): "plain" changes only the text K/V; "recache" (LongLive's)
    # also recomputes the K/V of the frames kept in the window under the new prompt.
    prompt_switch: str = "plain"

    def __post_init__(self) -> None:
        if self.prompt_switch not in PROMPT_SWITCHES:
            raise ValueError(f"prompt_switch {self.prompt_switch!r}: one of {list(PROMPT_SWITCHES)}")

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> WorldConfig:
        """Inverse of `to_dict`. Unknown keys fail with their names (a world's own settings
        belong in worldserve.json's "plugin" block, not here)."""
        data = dict(data)
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(
                f'unknown world settings {unknown}; world-specific settings belong in the "plugin" block'
            )
        sched = dict(data.pop("schedule", {}))
        if "steps" in sched:
            sched["steps"] = tuple(sched["steps"])
        return cls(schedule=FlowSchedule(**sched), **data)


@dataclass
class Conditioning:
    """What a new world starts from."""

    seed: int = 0  # RNG key of the session; also picks the start image of seeded worlds
    image: np.ndarray | None = None  # (H, W, 3) uint8 start frame for image-started worlds
    text: torch.Tensor | None = None  # (L, text_dim) precomputed prompt embedding
    prompt: str | None = None  # prompt text, resolved to `text` by the world's `prompts` in init_state


@dataclass
class WorldState:
    """One session's world on the device. Counters move only in the runtime's commit."""

    row: int  # the model's K/V pool row this session owns (self, action and text K/V)
    lease: int  # which holder of that row this is (rows are reused after release)
    decoder: DecoderCache  # streaming decoder state after the last committed chunk
    seed: int  # RNG key: chunk c, step k draws noise from hash(seed, c, k)
    chunks: int = 0  # committed chunks
    frames: int = 0  # committed latent frames (the KV length)
    video_frames: int = 0  # committed video frames (frame0 of the next chunk)
    start_latents: torch.Tensor | None = None  # (C, 1, h, w) image latent until the runner prefills it
    # The world's plug-in state (`models.plugin`): None until the plug-in makes one, or without one.
    plugin_state: PluginState | None = None
    prompt: str | None = None  # the prompt in force after a switch (None: the one it opened with)


@dataclass
class PreparedConditioning:
    """A new world's conditioning computed before it holds a pool row (`World.prepare`); tensors
    on the world's device, installed into the row by `World.init_state`."""

    seed: int  # the session's RNG key
    text_kv: TextKV  # every layer's cross-attention K/V of its text (an I2V world: image tokens)
    image_cond: torch.Tensor | None = None  # (4 + C, F, h, w) an I2V world's conditioning latents
    start_latents: torch.Tensor | None = None  # (C, 1, h, w) an image-started world's frame 0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds (a runtime that made them on another CUDA stream marks them)."""
        extra = [t for t in (self.image_cond, self.start_latents) if t is not None]
        return [*self.text_kv.k, *self.text_kv.v, *extra]


class PromptSource(Protocol):
    """Prompt text -> (L, text_dim) embeddings: models/prompts.py (precomputed files) or
    models/text_prompts.py (a text encoder; it also has `prepare`, which the runtime calls on its
    prompt worker before the world is built)."""

    def problem(self, prompt: str) -> str | None:
        """Why `prompt` cannot be embedded (None: it can)."""

    def embed(self, prompt: str) -> torch.Tensor:
        """(L, text_dim) float embeddings; raises ValueError."""


DEFAULT_MAX_SESSIONS = 16  # pool rows of a world nobody called `setup` on (the engine's default budget)


def _tensor_bytes(value: object) -> int:
    """Bytes of every tensor in a nest of tuples and lists."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def noise_seed(seed: int, chunk: int, step: int) -> int:
    """A 63-bit generator seed for (session seed, chunk, step): stateless, so rollback is free."""
    digest = hashlib.blake2b(f"{seed}:{chunk}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class World:
    """A loaded world model, ready to run chunk transactions for many sessions."""

    def __init__(
        self,
        config: WorldConfig,
        transformer: CausalWan,
        decoder: StreamingDecoder,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        start_image: Callable[[int], np.ndarray] | None = None,
        conditioner: ImageConditioner | None = None,
        plugin: WorldPlugin | None = None,
    ) -> None:
        self.config = config
        self.transformer = transformer.eval()
        self.decoder = decoder
        self.device = torch.device(device)
        self.dtype = dtype
        self._start_image = start_image  # seed -> start frame, for worlds that invent their own
        self.prompts: PromptSource | None = None  # prompt -> embeddings, for text_prompts worlds
        self.conditioner = conditioner  # I2V worlds: start frame -> conditioning latents + image tokens
        self.buckets: tuple[int, ...] | None = None  # compiled batch sizes; None: eager, any size
        self._denoise_fn = self._eager_denoise
        self._context_fn = self._eager_context
        # Decoders whose latents have a discrete part (tile-aligned anchors and phases) put
        # generated chunks in their canonical form before they are shown and become history.
        self._canonical = getattr(decoder, "canonical", None)
        tcfg = transformer.cfg
        if decoder.latent_channels != tcfg.out_channels:
            raise ValueError(
                f"decoder has {decoder.latent_channels} latent channels, DiT makes {tcfg.out_channels}"
            )
        if tcfg.image_dim and conditioner is None:
            raise ValueError("an I2V transformer needs an image conditioner (CLIP tower + VAE encoder)")
        if config.width % decoder.spatial or config.height % decoder.spatial:
            raise ValueError("frame size must be a multiple of the decoder's spatial factor")
        self.latent_shape = (
            tcfg.out_channels,
            config.height // decoder.spatial + decoder.margin_cells,
            config.width // decoder.spatial + decoder.margin_cells,
        )
        self.tokens_per_frame = transformer.tokens_per_frame(*self.latent_shape[1:])
        if config.text_prompts and config.prompt_switch == "recache":
            tcfg.keep_latents = True  # the re-cache recomputes K/V from them (before any pool exists)
        if tcfg.action is not None and tcfg.action.frames_per_latent != decoder.layout.frames_per_latent:
            raise ValueError("action frames_per_latent must equal the decoder's temporal factor")
        self.action_space = tcfg.action.space if tcfg.action is not None else ActionSpace()
        self.plugin: WorldPlugin | None = None  # the world's own behaviour (`models.plugin`)
        self.set_plugin(plugin)
        self._cache_bytes: int | None = None  # `decoder_cache_bytes`, measured on first use
        self._weights_hash: str | None = None  # computed once, by the first snapshot or restore

    def set_plugin(self, plugin: WorldPlugin | None) -> None:
        """Give the world its plug-in, bound to it (checked, on its device and dtype); None: none."""
        if plugin is not None:
            plugin.bind(self)
        self.plugin = plugin

    # -- description ----------------------------------------------------------------------------

    @property
    def layout(self) -> FrameLayout:
        """Latent-to-video frame mapping of this world's decoder."""
        return self.decoder.layout

    @property
    def chunk_frames(self) -> int:
        """Latent frames per chunk."""
        return self.transformer.cfg.chunk_frames

    @property
    def spec(self) -> ModelSpec:
        """Client-facing description."""
        c = self.config
        return ModelSpec(
            id=c.id,
            fps=c.fps,
            width=c.width,
            height=c.height,
            chunk_frames=self.chunk_frames * self.layout.frames_per_latent,
            action_space=self.action_space,
            image_start=c.image_start,
            description=c.description,
            prompts=c.text_prompts,
        )

    @property
    def start_frames(self) -> int:
        """Latent frames committed before chunk 1: 1 when the start image is prefilled as frame 0,
        0 otherwise (an I2V world's image conditions its chunks instead)."""
        return int(self.config.image_start and not self.transformer.cfg.image_dim)

    def kv_bytes_per_session(self) -> int:
        """Device bytes of one session's pool row (see `CausalWanConfig.kv_bytes`)."""
        return self.row_bytes()

    def session_bytes(self) -> int:
        """Device bytes one session holds: its pool row and, with a plug-in, two plug-in states
        (the committed one and a chunk's in flight; `WorldPlugin.state_bytes`)."""
        extra = 0 if self.plugin is None else 2 * self.plugin.state_bytes()
        return self.kv_bytes_per_session() + extra

    def checkpoint_bytes(self) -> int:
        """Device bytes one retained chunk holds besides its ring slack (a rewind's checkpoint,
        runtime/history.py): a plug-in state and a decoder cache."""
        plugin = 0 if self.plugin is None else self.plugin.state_bytes()
        return plugin + self.decoder_cache_bytes()

    @torch.no_grad()
    def decoder_cache_bytes(self) -> int:
        """Device bytes of one session's streaming decoder cache in steady state, measured once
        by decoding two chunks of zeros (0 for a decoder that keeps no tensors)."""
        if self._cache_bytes is None:
            c, h, w = self.latent_shape
            zeros = torch.zeros((c, self.chunk_frames, h, w), device=self.device, dtype=self.dtype)
            cache = self.decoder.init_cache()
            for _ in range(2):
                _, cache = self.decoder.decode(zeros, cache)
            self._cache_bytes = _tensor_bytes(cache.feats)
        return self._cache_bytes

    # -- the K/V pool ---------------------------------------------------------------------------

    def setup(self, max_sessions: int, slack_frames: int = 0) -> None:
        """Make the static K/V pool hold at least `max_sessions` rows (the runtime's stream
        budget) with `slack_frames` extra ring slots per row (room for a second chunk in flight:
        the pipelined decode, runtime/kv_cache.py). Growing copies every row, so live states keep
        their rows and contents; the slack can change only while no state holds a row."""
        pool = self.transformer.pool
        same_slack = pool is None or slack_frames == self.slack_frames
        if pool is not None and pool.rows >= max_sessions and same_slack:
            return
        if not same_slack and pool is not None and pool.owner:
            raise ValueError(
                f"{self.config.id}: the K/V pool's slack cannot change while "
                f"{len(pool.owner)} sessions hold rows"
            )
        _, h, w = self.latent_shape
        rows = max(max_sessions, pool.rows if pool is not None else 0)
        new = self.transformer.setup_caches(
            rows, h, w, dtype=self.dtype, device=self.device, slack_frames=slack_frames
        )
        if pool is not None and same_slack:
            new.copy_rows_from(pool)
        elif pool is not None:
            new.leases = pool.leases  # leases stay unique across the rebuild
        if self.buckets is not None:
            self._mark_pool_static()

    def _mark_pool_static(self) -> None:
        """Tell dynamo the pool buffers never move: CUDA graphs may then write them in place."""
        import torch._dynamo as dynamo

        pool = self.transformer.pool
        if pool is not None:
            for buf in pool.buffers():
                dynamo.mark_static_address(buf)

    @property
    def slack_frames(self) -> int:
        """Ring slots per pool row beyond the model's window (0 before `setup`)."""
        pool = self.transformer.pool
        if pool is None:
            return 0
        cfg = self.transformer.cfg
        return pool.capacity // self.tokens_per_frame - cfg.sink_frames - cfg.window_frames

    @property
    def max_sessions(self) -> int:
        """Rows of the pool (0 before `setup`)."""
        pool = self.transformer.pool
        return 0 if pool is None else pool.rows

    @property
    def free_rows(self) -> int:
        """Pool rows no state holds."""
        pool = self.transformer.pool
        return 0 if pool is None else pool.rows - len(pool.owner)

    @property
    def pad_row(self) -> int:
        """The pool row padding entries of a batch bucket use."""
        return self.transformer._pool().pad_row

    def row_bytes(self, slack_frames: int | None = None) -> int:
        """Device bytes of one pool row with `slack_frames` of ring slack (None: the pool's)."""
        slack = self.slack_frames if slack_frames is None else slack_frames
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.transformer.cfg.kv_bytes(self.tokens_per_frame, itemsize, slack_frames=slack)

    def resize(self, rows: int, slack_frames: int, live: Iterable[WorldState] = ()) -> None:
        """Rebuild the pool with `rows` session rows for the `live` states and `slack_frames` of
        ring slack, keeping every held row's contents: a `live` state whose row would fall off the
        end first moves to a free row; rows held by other states (another engine's on the same
        world) stay where they are, on top of `rows`. The slack can change only while no row is
        held."""
        live = list(live)
        pool = self.transformer.pool
        if pool is not None and pool.owner and slack_frames != self.slack_frames:
            raise ValueError(
                f"{self.config.id}: the K/V pool's slack cannot change while "
                f"{len(pool.owner)} sessions hold rows"
            )
        if pool is not None:
            mine = {s.row for s in live}
            others = set(pool.owner) - mine
            rows = max(rows + len(others), max(others, default=-1) + 1)
            free = iter(r for r in range(rows) if r not in mine and r not in others)
            for state in sorted(live, key=lambda s: s.row):
                if state.row >= rows:
                    self._move_row(state, next(free))
        _, h, w = self.latent_shape
        new = self.transformer.setup_caches(
            rows, h, w, dtype=self.dtype, device=self.device, slack_frames=slack_frames
        )
        if pool is not None:
            new.leases = pool.leases  # leases stay unique across the rebuild
            if pool.owner:
                new.copy_rows_from(pool)
        if self.buckets is not None:
            self._mark_pool_static()

    def _move_row(self, state: WorldState, row: int) -> None:
        pool = self.transformer._pool()
        pool.copy_row(state.row, row)
        del pool.owner[state.row]
        pool.owner[row] = state.lease
        state.row = row

    def _lease_row(self) -> tuple[int, int]:
        """A free row and a fresh lease on it (a ModelError when every row is held: the runtime's
        memory owner sizes the pool so that an admitted session always finds one)."""
        if self.transformer.pool is None:
            self.setup(DEFAULT_MAX_SESSIONS)
        pool = self.transformer._pool()
        free = [r for r in range(pool.rows) if r not in pool.owner]
        if not free:
            raise ModelError(f"all {self.max_sessions} K/V pool rows are taken")
        lease = next(pool.leases)
        pool.owner[free[0]] = lease
        pool.clear_row(free[0])
        return free[0], lease

    def _free_row(self, row: int, lease: int) -> None:
        owner = self.transformer._pool().owner
        if owner.get(row) == lease:  # a stale lease never frees a row someone else now holds
            del owner[row]

    def scrub_state(self, state: WorldState) -> None:
        """Clear non-finite values a rolled-back chunk left in the state's pool row."""
        self.transformer._pool().scrub_row(state.row)

    @torch.no_grad()
    def stage_prompt_row(self, src_row: int, prompt: str) -> tuple[int, int]:
        """A prompt switch's own pool row: a free row holding a copy of `src_row` with `prompt`'s
        text K/V; returns (row, lease). ConditioningError for a prompt this world cannot take,
        ModelError when no row is free. `src_row` is only read."""
        text = self._prompt_text(prompt)
        row, lease = self._lease_row()
        try:
            self.transformer._pool().copy_row(src_row, row)
            self.transformer.set_text(row, text.to(self.device, self.dtype))
        except Exception:
            self._free_row(row, lease)
            raise
        return row, lease

    def free_row(self, row: int, lease: int) -> None:
        """Give a (row, lease) back (a no-op when the lease no longer holds it)."""
        self._free_row(row, lease)

    @torch.no_grad()
    def recache(self, index: ChunkIndex) -> None:
        """LongLive's re-cache: the K/V of the frames `index` writes, recomputed from their kept
        clean latents (`CausalWanConfig.keep_latents`) under the row's text, in one clean pass in
        which they attend to each other (and the rows' other valid frames) without a causal mask."""
        pool = self.transformer._pool()
        t = self.tokens_per_frame
        slots = index.write[:, ::t] // t  # (B, n) frame slots
        lat = pool.latents[0].index_select(0, index.rows)  # (B, frame slots, C, h*w)
        x = torch.gather(lat, 1, slots[:, :, None, None].expand(-1, -1, *lat.shape[2:]))
        _, h, w = self.latent_shape
        x = x.transpose(1, 2).unflatten(3, (h, w))  # (B, C, n, h, w)
        sigma = self.config.context_noise
        tt = torch.full((x.shape[0],), sigma * self.config.schedule.num_train, device=self.device)
        self.transformer.forward_chunk(x.to(self.dtype), tt, index, None, need_output=False)

    def release_state(self, state: WorldState) -> None:
        """Give a state's pool row back (the state must not run again). Idempotent."""
        self._free_row(state.row, state.lease)

    # -- snapshots ------------------------------------------------------------------------------

    def weights_hash(self) -> str:
        """A hash of everything that decides this world's frames: its settings and the weights of
        its DiT, decoder and plug-in (blake2b over names, dtypes, shapes and bytes). Computed on
        first use and kept: weights never change while a world serves."""
        if self._weights_hash is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode())
            parts = [("dit", self.transformer)]
            for owner, obj in (("decoder", self.decoder), ("plugin", self.plugin)):
                for name, value in sorted(vars(obj).items()) if obj is not None else ():
                    if isinstance(value, torch.nn.Module):
                        parts.append((f"{owner}.{name}", value))
            for prefix, module in parts:
                for name, t in sorted(module.state_dict().items()):
                    t = t.detach().cpu().contiguous()
                    h.update(f"{prefix}.{name}:{t.dtype}:{tuple(t.shape)}".encode())
                    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._weights_hash = h.hexdigest()
        return self._weights_hash

    def _kept_frames(self, frames: int) -> list[int]:
        """The committed latent frames a later chunk can read: the sinks and the last window."""
        cfg = self.transformer.cfg
        s, w = cfg.sink_frames, cfg.window_frames
        return list(range(min(s, frames))) + list(range(max(s, frames - w), frames))

    def _token_slots(self, frames: list[int]) -> torch.Tensor:
        """Token slots (in a row) of these latent frames in the pool's ring, frame order."""
        s, t = self.transformer.cfg.sink_frames, self.tokens_per_frame
        ring = self.transformer.cfg.window_frames + self.slack_frames
        slots = [f if f < s else s + (f - s) % ring for f in frames]
        return torch.tensor([slot * t + i for slot in slots for i in range(t)], dtype=torch.long)

    def _slots_by_buffer(self, token_slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Where `token_slots` (frame-major) sit in each K/V buffer of a row: the self-attention
        K/V are frame-major, the action module's position-major (`motion_slots`)."""
        pool = self.transformer._pool()
        motion = motion_slots(token_slots, self.tokens_per_frame, pool.capacity // self.tokens_per_frame)
        return {"k": token_slots, "v": token_slots, "ak": motion, "av": motion}

    @torch.no_grad()
    def export_state(self, state: WorldState) -> tuple[dict[str, torch.Tensor], dict]:
        """A session's committed world as tensors (on the host) and JSON, for a snapshot: the
        filled part of its pool row in frame order ("kv.*": the frames a later chunk can read,
        so the ring's slack may differ where it is installed; "text.*": its text K/V; "extra.*":
        per-row extras), its decoder cache ("decoder.*"), its plug-in state ("plugin.*") and
        its counters. Reads only; the committed world must not be mid-chunk (the runtime settles
        first)."""
        if state.start_latents is not None:
            raise ValueError("a world whose start image is not prefilled yet cannot be saved")
        pool = self.transformer._pool()
        view = pool.row_view(state.row)
        frames = self._kept_frames(state.frames)
        idx = self._token_slots(frames).to(view["k"].device)
        n_text = int(pool.text_len[state.row])
        slots = self._slots_by_buffer(idx)
        tensors = {f"kv.{n}": view[n].index_select(1, slots[n]) for n in ("k", "v", "ak", "av")}
        tensors |= {f"text.{n}": view[n][:, :n_text] for n in ("tk", "tv")}
        tensors |= {f"extra.{n}": view[n] for n in pool.extras}
        dec, dec_meta = cache_to_tensors(state.decoder)
        tensors |= {f"decoder.{k}": v for k, v in dec.items()}
        plugin_meta = None
        if state.plugin_state is not None:
            if self.plugin is None:
                raise ValueError("a plug-in state without a plug-in")
            own, plugin_meta = self.plugin.state_to_tensors(state.plugin_state)
            tensors |= {f"plugin.{k}": v for k, v in own.items()}
        meta = {
            "seed": state.seed,
            "chunks": state.chunks,
            "frames": state.frames,
            "video_frames": state.video_frames,
            "kept_frames": len(frames),
            "text_tokens": n_text,
            "decoder": dec_meta,
            "plugin": plugin_meta,
        }
        # One copy to the host (a copy on the CPU too: the snapshot must not alias the live row).
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}, meta

    @torch.no_grad()
    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> WorldState:
        """Inverse of `export_state`: a new state in a free pool row holding the saved world
        (ValueError, and no row taken, when the tensors do not fit this world)."""
        frames = int(meta["frames"])
        kept = self._kept_frames(frames)
        if len(kept) != int(meta["kept_frames"]):
            raise ValueError(f"the snapshot keeps {meta['kept_frames']} frames; this world reads {len(kept)}")
        if meta.get("plugin") is not None and self.plugin is None:
            raise ValueError("the snapshot has a plug-in state; this world has no plug-in")
        plugin_state = None
        if meta.get("plugin") is not None:
            own = {k[len("plugin.") :]: v for k, v in tensors.items() if k.startswith("plugin.")}
            plugin_state = self.plugin.state_from_tensors(own, meta["plugin"])  # type: ignore[union-attr]
        dec = {k[len("decoder.") :]: v for k, v in tensors.items() if k.startswith("decoder.")}
        decoder = cache_from_tensors(dec, meta["decoder"], self.device)
        row, lease = self._lease_row()
        try:
            pool = self.transformer._pool()
            view = pool.row_view(row)
            slots = self._slots_by_buffer(self._token_slots(kept).to(view["k"].device))
            n_text = int(meta["text_tokens"])
            writes = [(view[n], f"kv.{n}", slots[n]) for n in ("k", "v", "ak", "av")]
            for buf, key, where in writes:
                src = tensors.get(key)
                want = (buf.shape[0], len(where), *buf.shape[2:])
                if src is None or tuple(src.shape) != want:
                    raise ValueError(
                        f"{key}: shape {None if src is None else tuple(src.shape)}, expected {want}"
                    )
                buf.index_copy_(1, where, src.to(buf.device, buf.dtype))
            for n in ("tk", "tv", *pool.extras):
                key = f"text.{n}" if n in ("tk", "tv") else f"extra.{n}"
                src, buf = tensors.get(key), view[n]
                dst = buf[:, :n_text] if n in ("tk", "tv") else buf
                if src is None or src.shape != dst.shape:
                    got = None if src is None else tuple(src.shape)
                    raise ValueError(f"{key}: shape {got}, expected {tuple(dst.shape)}")
                dst.copy_(src.to(buf.device, buf.dtype))
            pool.text_len[row] = n_text
            pool.text_lens[row] = n_text  # the host's copy, which attention cuts the text at
        except Exception:
            self._free_row(row, lease)
            raise
        return WorldState(
            row,
            lease,
            decoder,
            int(meta["seed"]),
            chunks=int(meta["chunks"]),
            frames=frames,
            video_frames=int(meta["video_frames"]),
            plugin_state=plugin_state,
        )

    def bucket(self, n: int) -> int | None:
        """The compiled batch size that holds `n` entries (None when eager: no padding)."""
        if self.buckets is None:
            return None
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"a batch of {n} exceeds the largest compiled bucket {self.buckets[-1]}")

    def compile(self, buckets: tuple[int, ...] = (1, 2, 4, 8), mode: str | None = None) -> None:
        """`torch.compile(fullgraph=True)` the two chunk forwards, one static graph per batch
        bucket (batches are padded up to a bucket, padding rows masked). `mode="reduce-overhead"`
        adds CUDA graphs on CUDA."""
        import torch._dynamo as dynamo

        self.buckets = tuple(sorted(set(buckets)))
        limit = max(8, 2 * len(self.buckets))
        if hasattr(dynamo.config, "recompile_limit"):
            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, limit)
        else:  # older torch
            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, limit)
        self._mark_pool_static()
        opts = {"fullgraph": True, "dynamic": False, "mode": mode}
        self._denoise_fn = torch.compile(self._eager_denoise, **opts)
        self._context_fn = torch.compile(self._eager_context, **opts)

    # -- the contract ---------------------------------------------------------------------------

    def prompt_problem(self, prompt: str) -> str | None:
        """Why this world cannot take `prompt` (None: it can). Cheap: reads no tensor."""
        if not self.config.text_prompts:
            return f"model {self.config.id} has no text encoder; omit `prompt`"
        if self.prompts is None:
            return (
                f"model {self.config.id} takes prompts, but this server has no prompt embeddings "
                "(start it with --text-encoder DIR or --prompt-embeds DIR)"
            )
        return self.prompts.problem(prompt)

    def _prompt_text(self, prompt: str) -> torch.Tensor:
        """The prompt's embeddings, zero-padded to the pool's text length: Self-Forcing attends to
        every one of its 512 text rows, padding included, so the padding must be there."""
        problem = self.prompt_problem(prompt)
        if problem is not None or self.prompts is None:
            raise ConditioningError("prompt", problem or "no prompt source")
        try:
            text = self.prompts.embed(prompt)
        except ValueError as exc:
            raise ConditioningError("prompt", str(exc)) from exc
        pad = self.transformer.cfg.text_tokens - text.shape[0]
        return torch.cat([text, text.new_zeros(pad, text.shape[1])]) if pad > 0 else text

    @property
    def heavy_conditioning(self) -> bool:
        """Whether `prepare` runs a network (an image encoder, a vision tower): the runtime then
        computes it off the thread that steps the chunks (runtime/conditioning.py). A world that
        only looks up a prompt or takes the null text prepares inline."""
        return self.conditioner is not None or self.config.image_start

    @torch.no_grad()
    def prepare(self, cond: Conditioning) -> PreparedConditioning:
        """Everything a new world for `cond` needs that does not depend on its pool row: the
        checks of `cond`, the start image's latents, the text K/V of every layer (an I2V world:
        its image conditioning, see `_prepare_i2v`). Reads weights and writes nothing of the
        world's, so it may run on another thread while chunks run (one `prepare` at a time: a
        VAE encoder keeps scratch on its module). Raises `ConditioningError` for a bad `cond`."""
        tcfg = self.transformer.cfg
        if tcfg.image_dim:
            return self._prepare_i2v(cond)
        text = cond.text
        if text is None and cond.prompt:
            text = self._prompt_text(cond.prompt)
        if text is None:
            text = self.transformer.null_text(self.device, self.dtype)
        elif text.ndim != 2 or text.shape[1] != tcfg.text_dim:
            raise ConditioningError("prompt", f"text embedding must be (L, {tcfg.text_dim})")
        elif text.shape[0] > tcfg.text_tokens:
            raise ConditioningError("prompt", f"text embedding has more than {tcfg.text_tokens} tokens")
        start_latents = self._start_latents(cond)
        text_kv = self.transformer.text_kv(text.to(self.device, self.dtype))
        return PreparedConditioning(int(cond.seed), text_kv, start_latents=start_latents)

    @torch.no_grad()
    def init_state(self, cond: Conditioning, prepared: PreparedConditioning | None = None) -> WorldState:
        """An empty world for `cond`: takes a row of the K/V pool and stores its text K/V there
        (an I2V world: its image conditioning). `prepared`: `prepare(cond)` computed before (None:
        computed here)."""
        if prepared is None:
            prepared = self.prepare(cond)
        row, lease = self._lease_row()
        try:
            self.transformer.set_text_kv(row, prepared.text_kv)
            if prepared.image_cond is not None:
                self.transformer.set_image_cond(row, prepared.image_cond)
        except Exception:
            self._free_row(row, lease)
            raise
        return WorldState(
            row, lease, self.decoder.init_cache(), prepared.seed, start_latents=prepared.start_latents
        )

    def _prepare_i2v(self, cond: Conditioning) -> PreparedConditioning:
        """An I2V world (Matrix-Game): the start frame conditions every chunk instead of being
        committed as frame 0; its latents and image tokens go to the session's pool row."""
        if cond.text is not None:
            raise ConditioningError("prompt", f"{self.config.id} is conditioned on an image, not a prompt")
        image = cond.image
        if image is None:
            if self._start_image is None:
                raise ConditioningError("image", f"{self.config.id} starts from an image; send open.image")
            image = self._start_image(int(cond.seed))
        if (
            not isinstance(image, np.ndarray)
            or image.dtype != np.uint8
            or image.ndim != 3
            or image.shape[2] != 3
        ):
            got = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
            raise ConditioningError("image", f"image must be an (H, W, 3) uint8 RGB frame, got {got}")
        assert self.conditioner is not None  # checked in __init__
        latents, tokens = self.conditioner(image, self.config.height, self.config.width)
        text_kv = self.transformer.text_kv(tokens.to(self.device, self.dtype))
        return PreparedConditioning(int(cond.seed), text_kv, image_cond=latents.to(self.device, self.dtype))

    def _start_latents(self, cond: Conditioning) -> torch.Tensor | None:
        if self.config.image_start:
            image = cond.image
            if image is None:
                if self._start_image is None:
                    raise ConditioningError(
                        "image", f"{self.config.id} starts from an image; send open.image"
                    )
                image = self._start_image(int(cond.seed))
            expected = (self.config.height, self.config.width, 3)
            if image.shape != expected or image.dtype != np.uint8:
                raise ConditioningError(
                    "image", f"image must be uint8 {expected}, got {image.dtype} {image.shape}"
                )
            return self.decoder.encode(image[None]).to(self.device, self.dtype)
        if cond.image is not None:
            raise ConditioningError("image", f"{self.config.id} does not take a start image")
        return None

    @torch.no_grad()
    def fork_state(self, state: WorldState) -> WorldState:
        """A copy of the committed world in a fresh pool row. Decoder-cache tensors are never
        written in place, so they are shared."""
        row, lease = self._lease_row()
        self.transformer._pool().copy_row(state.row, row)
        return replace(state, row=row, lease=lease)

    def noise(self, seed: int, chunk: int, step: int, n_frames: int) -> torch.Tensor:
        """Deterministic noise (C, n, h, w) for one session's chunk and step.

        Drawn on the CPU and copied, so a seed gives the same world on every device (up to float
        error) and a replay on another machine draws the same numbers."""
        return self.noise_batch([(seed, chunk, step)], n_frames)[0]

    def noise_batch(self, keys: Sequence[tuple[int, int, int] | None], n_frames: int) -> torch.Tensor:
        """(len(keys), C, n, h, w): entry i is `noise(*keys[i], n_frames)`, zeros where keys[i]
        is None (batch padding). Drawn on the CPU into one buffer by one generator, re-seeded per
        entry (each session's numbers come from its own stateless stream, so they never depend on
        its batch mates), and copied to the device once."""
        c, h, w = self.latent_shape
        out = torch.zeros((len(keys), c, n_frames, h, w), dtype=torch.float32)
        gen = torch.Generator()
        for i, key in enumerate(keys):
            if key is not None:
                torch.randn((c, n_frames, h, w), generator=gen.manual_seed(noise_seed(*key)), out=out[i])
        if self.device.type == "cuda":
            out = out.pin_memory()
        return out.to(self.device, self.dtype, non_blocking=True)

    @torch.no_grad()
    def denoise(
        self, x_t: torch.Tensor, t: float, index: ChunkIndex, actions: torch.Tensor | None
    ) -> torch.Tensor:
        """One denoising forward for a batch: x_t (B, C, n, h, w) -> prediction (B, C, n, h, w)."""
        tt = torch.full((x_t.shape[0],), float(t), device=self.device, dtype=torch.float32)
        return self._denoise_fn(x_t, tt, index, self._actions(actions))

    @torch.no_grad()
    def canonical(self, x0: torch.Tensor) -> torch.Tensor:
        """Generated latents (B, C, n, h, w) in the form they are shown in and kept as history:
        the decoder's `canonical` where it has one (a discrete part put in order), else
        as they are."""
        return x0 if self._canonical is None else self._canonical(x0)

    @torch.no_grad()
    def context(
        self,
        x0: torch.Tensor,
        index: ChunkIndex,
        actions: torch.Tensor | None,
        noise: torch.Tensor | None = None,
    ) -> None:
        """The clean pass: leaves the chunk's K/V in each entry's scratch slots. A generated x0
        goes through `canonical` first (the runner does, before it also decodes it)."""
        sigma = self.config.context_noise
        x = x0 if sigma == 0 or noise is None else add_noise(x0, noise, sigma)
        tt = torch.full((x0.shape[0],), sigma * self.config.schedule.num_train, device=self.device)
        self._context_fn(x, tt, index, self._actions(actions))
        if self.transformer.cfg.keep_latents:  # kept beside their K/V, for a re-cache
            pool = self.transformer._pool()
            slots = index.write[:, :: self.tokens_per_frame] // self.tokens_per_frame
            lat = pool.latents[0]
            lat.index_put_((index.rows[:, None], slots), x0.transpose(1, 2).flatten(3).to(lat.dtype))

    def _eager_denoise(
        self, x: torch.Tensor, t: torch.Tensor, index: ChunkIndex, actions: torch.Tensor | None
    ) -> torch.Tensor:
        return self.transformer.forward_chunk(x, t, index, actions)

    def _eager_context(
        self, x: torch.Tensor, t: torch.Tensor, index: ChunkIndex, actions: torch.Tensor | None
    ) -> None:
        self.transformer.forward_chunk(x, t, index, actions, need_output=False)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, state: WorldState) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) -> frames (T, H, W, 3) uint8 and the decoder cache after them."""
        return self.decoder.decode(latents, state.decoder)

    @torch.no_grad()
    def decode_batch(
        self, latents: Sequence[torch.Tensor], states: Sequence[WorldState]
    ) -> tuple[list[torch.Tensor], list[DecoderCache]]:
        """Many sessions' latents (C, n, h, w) -> their frames (T, H, W, 3) uint8 and new decoder
        caches, batched where the decoder can (`models.vae.decode_batch`); states are untouched."""
        return decode_batch(self.decoder, list(latents), [s.decoder for s in states])

    def _actions(self, actions: torch.Tensor | None) -> torch.Tensor | None:
        if actions is None or self.transformer.cfg.action is None:
            return None
        return actions.to(self.device, self.dtype)
