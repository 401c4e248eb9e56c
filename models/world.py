"""The world-model contract: a causal DiT, a streaming decoder and a schedule, batched over sessions.

`World` implements the four calls the runtime's chunk transaction is built from
(shared/DESIGN.md, "The world-model contract"):

* `init_state(cond)` -> `WorldState`: an empty KV cache, decoder cache, RNG key, counters;
* `denoise(x_t, t, states, slots, actions)` -> prediction; reads committed K/V, writes scratch only;
* `context(x0, states, slots, actions)`: the clean pass that leaves the chunk's K/V in scratch;
* `decode(latents, state)` -> frames and a *new* decoder cache (the old one is untouched).

Nothing here advances a counter: committing is the runtime's job. No loop, no sessions, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from models.actions import ActionSpace, FrameLayout
from models.causal_wan import CacheSlots, CausalWan, KVCache, TextKV
from models.sampler import FlowSchedule, add_noise
from models.vae import DecoderCache, StreamingDecoder


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


@dataclass
class WorldConfig:
    """Serving settings of a world (stored as worldserve.json beside the weights)."""

    id: str  # registry name
    fps: float  # video frames per second for playback
    width: int  # video frame width, pixels
    height: int  # video frame height, pixels
    schedule: FlowSchedule = field(default_factory=FlowSchedule)  # noise levels per chunk
    context_noise: float = 0.0  # sigma of the history the context pass writes (0: clean)
    image_start: bool = False  # a new world prefills an encoded start image as committed frame 0
    description: str = ""

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> WorldConfig:
        """Inverse of `to_dict`."""
        data = dict(data)
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


@dataclass
class WorldState:
    """One session's world on the device. Counters move only in the runtime's commit."""

    kv: KVCache  # per-layer K/V in frame slots (see KVCache for the layout)
    text: TextKV  # constant cross-attention K/V
    decoder: DecoderCache  # streaming decoder state after the last committed chunk
    seed: int  # RNG key: chunk c, step k draws noise from hash(seed, c, k)
    chunks: int = 0  # committed chunks
    frames: int = 0  # committed latent frames (the KV length)
    video_frames: int = 0  # committed video frames (frame0 of the next chunk)
    start_latents: torch.Tensor | None = None  # (C, 1, h, w) image latent until the runner prefills it


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
    ) -> None:
        self.config = config
        self.transformer = transformer.eval()
        self.decoder = decoder
        self.device = torch.device(device)
        self.dtype = dtype
        self._start_image = start_image  # seed -> start frame, for worlds that invent their own
        tcfg = transformer.cfg
        if decoder.latent_channels != tcfg.in_channels:
            raise ValueError(
                f"decoder has {decoder.latent_channels} latent channels, DiT takes {tcfg.in_channels}"
            )
        if config.width % decoder.spatial or config.height % decoder.spatial:
            raise ValueError("frame size must be a multiple of the decoder's spatial factor")
        self.latent_shape = (
            tcfg.in_channels,
            config.height // decoder.spatial,
            config.width // decoder.spatial,
        )
        self.tokens_per_frame = transformer.tokens_per_frame(*self.latent_shape[1:])
        if tcfg.action is not None and tcfg.action.frames_per_latent != decoder.layout.frames_per_latent:
            raise ValueError("action frames_per_latent must equal the decoder's temporal factor")
        self.action_space = tcfg.action.space if tcfg.action is not None else ActionSpace()

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
        )

    def kv_bytes_per_session(self) -> int:
        """Device bytes of one session's KV cache (see `CausalWanConfig.kv_bytes`)."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.transformer.cfg.kv_bytes(self.tokens_per_frame, itemsize)

    # -- the contract ---------------------------------------------------------------------------

    @torch.no_grad()
    def init_state(self, cond: Conditioning) -> WorldState:
        """An empty world for `cond` (allocates this session's KV cache on the device)."""
        _, h, w = self.latent_shape
        kv = self.transformer.new_cache(h, w, self.device, self.dtype)
        text = cond.text
        if text is None:
            text = self.transformer.null_text(self.device, self.dtype)
        elif text.ndim != 2 or text.shape[1] != self.transformer.cfg.text_dim:
            raise ConditioningError("prompt", f"text embedding must be (L, {self.transformer.cfg.text_dim})")
        state = WorldState(
            kv=kv,
            text=self.transformer.text_kv(text.to(self.device, self.dtype)),
            decoder=self.decoder.init_cache(),
            seed=int(cond.seed),
        )
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
            state.start_latents = self.decoder.encode(image[None]).to(self.device, self.dtype)
        elif cond.image is not None:
            raise ConditioningError("image", f"{self.config.id} does not take a start image")
        return state

    def fork_state(self, state: WorldState) -> WorldState:
        """A copy of the committed world. Decoder-cache and text tensors are never written in place,
        so they are shared; the KV buffers are written (scratch) and are copied."""
        kv = self.transformer.new_cache(*self.latent_shape[1:], self.device, self.dtype)
        kv.load_state_dict(state.kv.state_dict())
        return replace(state, kv=kv)

    def noise(self, seed: int, chunk: int, step: int, n_frames: int) -> torch.Tensor:
        """Deterministic noise (C, n, h, w) for one session's chunk and step."""
        gen = torch.Generator(device=self.device).manual_seed(noise_seed(seed, chunk, step))
        c, h, w = self.latent_shape
        return torch.randn((c, n_frames, h, w), generator=gen, device=self.device, dtype=torch.float32).to(
            self.dtype
        )

    @torch.no_grad()
    def denoise(
        self,
        x_t: torch.Tensor,
        t: float,
        states: Sequence[WorldState],
        slots: Sequence[CacheSlots],
        actions: torch.Tensor | None,
    ) -> torch.Tensor:
        """One denoising forward for a batch of sessions: x_t (B, C, n, h, w) -> prediction."""
        tt = torch.full((x_t.shape[0],), float(t), device=self.device, dtype=torch.float32)
        return self.transformer.forward_chunk(
            x_t, tt, [s.kv for s in states], slots, [s.text for s in states], self._actions(actions)
        )

    @torch.no_grad()
    def context(
        self,
        x0: torch.Tensor,
        states: Sequence[WorldState],
        slots: Sequence[CacheSlots],
        actions: torch.Tensor | None,
        noise: torch.Tensor | None = None,
    ) -> None:
        """The clean pass: leaves the chunk's K/V in each session's scratch slots."""
        sigma = self.config.context_noise
        x = x0 if sigma == 0 or noise is None else add_noise(x0, noise, sigma)
        tt = torch.full((x0.shape[0],), sigma * self.config.schedule.num_train, device=self.device)
        self.transformer.forward_chunk(
            x,
            tt,
            [s.kv for s in states],
            slots,
            [s.text for s in states],
            self._actions(actions),
            need_output=False,
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, state: WorldState) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) -> frames (T, H, W, 3) uint8 and the decoder cache after them."""
        return self.decoder.decode(latents, state.decoder)

    def _actions(self, actions: torch.Tensor | None) -> torch.Tensor | None:
        if actions is None or self.transformer.cfg.action is None:
            return None
        return actions.to(self.device, self.dtype)
