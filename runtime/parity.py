"""Golden parity: replay an original causal rollout (a golden file) through the served path.

A golden file (docs/MODELS.md, "Golden fixtures") stores what the original code drew and
produced: the initial noise, the re-noise draws, the conditioning, and every output of every
call. `replay` runs the same rollout through a loaded `World` and a real `Engine` (the batched
pool path the server runs: scheduler, runner, transaction, commit), with the world's noise
draws replaced by the stored ones, and records what the served model produced at the same
points: each call's input and timestep, the flow prediction and x0 of every denoising step,
every block's output (forward hooks), the context pass, and the final latents. `compare`
gives the max abs difference per stored output.

The noise draws are swapped at `World.noise_batch` (the one place a served chunk's noise enters),
and `World.denoise` / `World.context` are wrapped on the instance to record their traffic
(`World.recache`, a prompt switch's re-cache, records nothing: the original's is not stored; an
image-conditioned golden also swaps `World.conditioner`, below); all are restored afterwards. One
stream runs, so batches have one entry.

A family's inputs come from `INPUTS[family]`: the session's Conditioning and each chunk's
actions, built from the golden's stored conditioning. Self-Forcing: `prompt_embeds` as the
session's text, no actions. LongLive: the same, and a golden's `switch_frame_indices` become
`prompt` switches on the chunks that start there, its segments' embeddings served by
`GoldenPrompts` in place of the world's prompt source. Matrix-Game 2.0: the world's image
conditioner (CLIP tower + VAE encoder) is swapped for `GoldenConditioner`, which hands every
session the golden's `cond_concat` / `visual_context` (so the start image the session sends
is a placeholder), and the golden's video-rate `keyboard` / `mouse` rows become protocol frame
actions (`golden_actions`), split into chunks as the served path consumes them. Other families are
`ParityUnsupported`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from models.actions import ActionSpace, FrameAction
from models.convert.matrix_game import MOUSE_SCALE
from models.world import Conditioning, World
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest

STREAM = "parity"
# Stored outputs, by name (c = chunk, s = denoising step, ctx = the context pass at t = 0).
OUTPUT = re.compile(r"^(input|t|flow|x0)\.c\d+\.(s\d+|ctx)$|^block\d+\.c\d+\.(s\d+|ctx)$|^latents$")


class ParityUnsupported(ValueError):
    """The golden file needs something the served model path cannot replay (yet)."""


@dataclass
class Golden:
    """A golden rollout file: tensors and decoded metadata."""

    tensors: dict[str, torch.Tensor]
    meta: dict

    @property
    def family(self) -> str:
        """The model family that made it ("self-forcing", "matrix-game-2")."""
        return str(self.meta.get("family", "unknown"))

    @property
    def outputs(self) -> list[str]:
        """Stored outputs replay can be compared on, in file order."""
        return [k for k in self.tensors if OUTPUT.match(k)]


@dataclass
class ParityResult:
    """Max abs difference per stored output, and what could not be compared."""

    diffs: dict[str, float] = field(default_factory=dict)
    not_produced: list[str] = field(default_factory=list)  # stored, but the replay made no such value

    @property
    def worst(self) -> tuple[str, float]:
        """The output with the largest difference."""
        name = max(self.diffs, key=lambda k: self.diffs[k])
        return name, self.diffs[name]

    def groups(self) -> dict[str, float]:
        """Max difference per kind of output (input, t, flow, x0, block, ctx, latents)."""
        out: dict[str, float] = {}
        for name, d in self.diffs.items():
            head = name.split(".")[0]
            kind = "ctx" if name.endswith(".ctx") else "block" if head.startswith("block") else head
            out[kind] = max(out.get(kind, 0.0), d)
        return out

    def summary(self, tolerance: float, **extra: object) -> dict:
        """The JSON summary `worldserve parity` prints."""
        name, worst = self.worst
        return {
            **extra,
            "tolerance": tolerance,
            "compared": len(self.diffs),
            "max_abs_diff": worst,
            "worst": name,
            "groups": self.groups(),
            "not_produced": self.not_produced,
            "pass": worst <= tolerance and not self.not_produced,
        }


def load_golden(path: str | Path) -> Golden:
    """A golden safetensors file (metadata values are JSON strings)."""
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
        raw = f.metadata() or {}
    meta = {}
    for k, v in raw.items():
        try:
            meta[k] = json.loads(v)
        except json.JSONDecodeError:
            meta[k] = v
    if "rollout" not in meta or "noise" not in tensors:
        raise ValueError(f"{path}: not a golden rollout file (needs `noise` and `rollout` metadata)")
    return Golden(tensors, meta)


def _self_forcing_inputs(world: World, golden: Golden) -> tuple[Conditioning, list[list[FrameAction]]]:
    text = golden.tensors.get("prompt_embeds")
    cond = Conditioning(seed=0, text=None if text is None else text[0].to(world.device, world.dtype))
    return cond, [[] for _ in range(golden.meta["rollout"]["chunks"])]


class GoldenPrompts:
    """A prompt source (`models.world.PromptSource`) of a switching golden's segments: prompt
    "segment i" is its `prompt_embeds.i` (segment 0: `prompt_embeds`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @staticmethod
    def name(segment: int) -> str:
        """The prompt text that stands for a segment."""
        return f"segment {segment}"

    def _key(self, prompt: str) -> str:
        i = int(prompt.removeprefix("segment "))
        return "prompt_embeds" if i == 0 else f"prompt_embeds.{i}"

    def problem(self, prompt: str) -> str | None:
        """None for a segment the golden has."""
        ok = prompt.startswith("segment ") and prompt[8:].isdigit() and self._key(prompt) in self.tensors
        return None if ok else f"the golden has no prompt {prompt!r}"

    def embed(self, prompt: str) -> torch.Tensor:
        """The segment's stored embeddings (L, text_dim)."""
        return self.tensors[self._key(prompt)][0]


def switches(golden: Golden, chunk_frames: int) -> dict[int, str]:
    """Golden chunk index -> the prompt it switches to (`rollout.switch_frame_indices`)."""
    frames = golden.meta["rollout"].get("switch_frame_indices", [])
    if any(f % chunk_frames for f in frames):
        raise ValueError(f"golden switch frames {frames} are not at chunk boundaries of {chunk_frames}")
    return {f // chunk_frames: GoldenPrompts.name(i + 1) for i, f in enumerate(frames)}


class GoldenConditioner:
    """Stands in for an I2V world's image conditioner (CLIP tower + VAE encoder): every session
    gets the original's conditioning stored in the golden, whatever image it sends."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.latents = tensors["cond_concat"][0]  # (4 mask + C, F, h, w)
        self.tokens = tensors["visual_context"][0]  # (L, image_dim)

    def __call__(self, image: np.ndarray, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored (conditioning latents, image tokens); `image` is not read."""
        return self.latents, self.tokens


def golden_actions(
    space: ActionSpace, keyboard: torch.Tensor, mouse: torch.Tensor | None = None
) -> list[FrameAction]:
    """The original's raw video-rate actions as protocol frames: `keyboard` (T, keys) multi-hot
    by the space's key columns, `mouse` (T, 2) [pitch, yaw] back to (dx, dy) = (yaw, -pitch) / scale
    (the inverse of the served mapping, models/convert/matrix_game.py `MOUSE`)."""
    if keyboard.shape[1] != len(space.keys):
        raise ValueError(f"golden keyboard has {keyboard.shape[1]} columns, the model's keys {space.keys}")
    if (mouse is not None) != space.mouse:
        raise ValueError(
            f"golden {'has' if mouse is not None else 'has no'} mouse rows; the model "
            f"{'reads' if space.mouse else 'does not read'} the mouse"
        )
    out = []
    for r in range(keyboard.shape[0]):
        held = frozenset(k for k, v in zip(space.keys, keyboard[r].tolist(), strict=True) if v > 0.5)
        dxdy = (0.0, 0.0)
        if mouse is not None:
            pitch, yaw = mouse[r].tolist()
            dxdy = (yaw / MOUSE_SCALE, -pitch / MOUSE_SCALE)
        out.append(FrameAction(keys=held, mouse=dxdy))
    return out


def _matrix_game_inputs(world: World, golden: Golden) -> tuple[Conditioning, list[list[FrameAction]]]:
    g = golden.tensors
    frames = golden_actions(world.action_space, g["keyboard"][0], g["mouse"][0] if "mouse" in g else None)
    chunks, start = [], 0
    for c in range(golden.meta["rollout"]["chunks"]):  # chunk 1 holds 1 + 4 (n - 1) video frames
        end = start + world.layout.video_frames(c * world.chunk_frames, world.chunk_frames)
        if end > len(frames):
            raise ValueError(f"golden actions hold {len(frames)} video frames, chunk {c} needs {end}")
        chunks.append(frames[start:end])
        start = end
    # the image only has to be valid: GoldenConditioner supplies the conditioning
    return Conditioning(seed=0, image=np.zeros((8, 8, 3), np.uint8)), chunks


# family -> (world, golden) -> the session's conditioning and each chunk's frame actions
INPUTS: dict[str, Callable[[World, Golden], tuple[Conditioning, list[list[FrameAction]]]]] = {
    "self-forcing": _self_forcing_inputs,
    "longlive": _self_forcing_inputs,
    "matrix-game-2": _matrix_game_inputs,
}


def check(world: World, golden: Golden) -> None:
    """Raise ParityUnsupported / ValueError when `world` cannot replay `golden`."""
    if golden.family not in INPUTS:
        raise ParityUnsupported(
            f"{golden.family} goldens are not supported: supported families: {', '.join(INPUTS)}"
        )
    roll = golden.meta["rollout"]
    tcfg = world.transformer.cfg
    image = "cond_concat" in golden.tensors
    if image != bool(tcfg.image_dim):
        raise ValueError(
            f"the golden ({golden.family}) is {'image' if image else 'text'}-conditioned, "
            f"model {world.config.id} is {'image' if tcfg.image_dim else 'text'}-conditioned"
        )
    if image and tcfg.cond_frames < roll["chunks"] * tcfg.chunk_frames:
        # fewer kept frames would reuse the last for later chunks, not what the original read
        raise ValueError(
            f"the model keeps {tcfg.cond_frames} conditioning frames, the golden rollout reads "
            f"{roll['chunks'] * tcfg.chunk_frames}"
        )
    noise = golden.tensors["noise"]
    if world.chunk_frames != roll["num_frame_per_block"]:
        raise ValueError(
            f"golden chunks are {roll['num_frame_per_block']} latent frames, the model's {world.chunk_frames}"
        )
    if tuple(noise.shape[1:2]) + tuple(noise.shape[3:]) != tuple(world.latent_shape):
        raise ValueError(
            f"golden latents are (C, h, w) {(noise.shape[1], *noise.shape[3:])}, "
            f"the model's {tuple(world.latent_shape)}"
        )
    if noise.shape[2] < roll["chunks"] * world.chunk_frames:
        raise ValueError(f"golden noise holds {noise.shape[2]} frames for {roll['chunks']} chunks")


class _Recorder:
    """Swaps the world's noise for the golden draws and records the served path's traffic."""

    def __init__(self, world: World, golden: Golden) -> None:
        self.world, self.golden = world, golden
        self.n = world.chunk_frames
        self.values: dict[str, torch.Tensor] = {}
        self.chunk = 0  # golden chunk index of the chunk running now
        self.step = 0  # denoising step within it
        self.label = ""  # of the forward running now
        self.base = 1  # engine chunk number of golden chunk 0 (set by `replay`)
        self.hooks: list = []
        self.conditioner = world.conditioner  # restored on exit
        self.prompts = world.prompts  # restored on exit

    # -- the swapped / wrapped World methods ----------------------------------------------------

    def noise_batch(self, keys: Sequence[tuple[int, int, int] | None], n_frames: int) -> torch.Tensor:
        w = self.world
        c, h, wd = w.latent_shape
        out = torch.zeros((len(keys), c, n_frames, h, wd))
        for i, key in enumerate(keys):
            if key is not None:
                _, chunk, step = key
                out[i] = self._draw(chunk - self.base, step)[0]
        return out.to(w.device, w.dtype)

    def _draw(self, c: int, step: int) -> torch.Tensor:
        g = self.golden.tensors
        if step == 0:
            return g["noise"][:, :, c * self.n : (c + 1) * self.n]
        name = f"renoise.c{c}.s{step - 1}"
        if name not in g:
            raise ValueError(f"the golden file has no {name} (the re-noise draw before step {step})")
        return g[name]

    def denoise(self, orig, x_t: torch.Tensor, t: float, index, actions) -> torch.Tensor:
        s = self.step
        self.label = f"c{self.chunk}.s{s}"
        pred = orig(x_t, t, index, actions)
        sched = self.world.config.schedule
        self._put(f"input.{self.label}", x_t)
        self._put(f"t.{self.label}", torch.tensor([float(t)]))
        self._put(f"flow.{self.label}", pred)
        self._put(f"x0.{self.label}", sched.to_x0(pred.float(), x_t.float(), sched.sigmas[s]))
        self.step += 1
        return pred

    def context(self, orig, x0: torch.Tensor, index, actions, noise=None) -> None:
        self.label = f"c{self.chunk}.ctx"
        cfg = self.world.config
        self._put(f"input.{self.label}", x0)
        self._put(f"t.{self.label}", torch.tensor([cfg.context_noise * cfg.schedule.num_train]))
        orig(x0, index, actions, noise=noise)
        self.chunk += 1
        self.step = 0

    def recache(self, orig, index) -> None:
        # a prompt switch's re-cache: no stored output to compare (the golden records none), its
        # effect shows in every call after it
        self.label = f"c{self.chunk}.recache"
        orig(index)

    def _put(self, name: str, value: torch.Tensor) -> None:
        if not self.label.endswith("recache"):
            self.values[name] = value.detach().float().cpu()

    # -- install / remove -----------------------------------------------------------------------

    def __enter__(self) -> _Recorder:
        w = self.world
        den, ctx, rc = w.denoise, w.context, w.recache
        w.recache = lambda *a, **k: self.recache(rc, *a, **k)  # type: ignore[method-assign]
        w.noise_batch = self.noise_batch  # type: ignore[method-assign]
        w.denoise = lambda *a, **k: self.denoise(den, *a, **k)  # type: ignore[method-assign]
        w.context = lambda *a, **k: self.context(ctx, *a, **k)  # type: ignore[method-assign]
        if "cond_concat" in self.golden.tensors:
            w.conditioner = GoldenConditioner(self.golden.tensors)  # type: ignore[assignment]
        if "prompt_embeds.1" in self.golden.tensors:  # a switching golden's segments
            w.prompts = GoldenPrompts(self.golden.tensors)
        for i, blk in enumerate(w.transformer.blocks):
            self.hooks.append(blk.register_forward_hook(self._block_hook(i)))
        return self

    def _block_hook(self, i: int):
        def hook(_module, _args, output: torch.Tensor) -> None:
            self._put(f"block{i}.{self.label}", output)

        return hook

    def __exit__(self, *exc: object) -> None:
        for name in ("noise_batch", "denoise", "context", "recache"):
            self.world.__dict__.pop(name, None)  # back to the class's methods
        self.world.conditioner = self.conditioner
        self.world.prompts = self.prompts
        for h in self.hooks:
            h.remove()


def replay(world: World, golden: Golden) -> dict[str, torch.Tensor]:
    """Run the golden rollout through `world` behind a real Engine; the recorded values by name."""
    check(world, golden)
    cond, actions = INPUTS[golden.family](world, golden)
    prompts = switches(golden, world.chunk_frames)
    if prompts and not world.config.text_prompts:
        raise ValueError(f"the golden switches prompts; model {world.config.id} takes no prompt")
    engine = Engine({world.config.id: world}, max_batch=1, max_streams=1)
    with _Recorder(world, golden) as rec:
        engine.add_stream(STREAM, world.config.id, cond)
        try:
            rec.base = engine.runner.streams[STREAM].state.chunks + 1
            for c, chunk_actions in enumerate(actions):
                req = ChunkRequest(
                    STREAM, engine.new_request_id(), actions=chunk_actions, prompt=prompts.get(c)
                )
                engine.submit(req)
                outcomes = []
                while engine.has_work():
                    outcomes += engine.step()
                if not any(isinstance(o, ChunkCommitted) for o in outcomes):
                    raise RuntimeError(f"the served path did not commit a chunk: {outcomes}")
        finally:
            engine.remove_stream(STREAM)
    values = rec.values
    chunks = [values[f"input.c{c}.ctx"] for c in range(len(actions))]
    values["latents"] = torch.cat(chunks, dim=2)
    return values


def compare(golden: Golden, values: dict[str, torch.Tensor]) -> ParityResult:
    """Max abs difference of every stored output against the replayed values."""
    result = ParityResult()
    for name in golden.outputs:
        ours = values.get(name)
        ref = golden.tensors[name].float()
        if ours is None or ours.shape != ref.shape:
            result.not_produced.append(name if ours is None else f"{name} (shape {tuple(ours.shape)})")
            continue
        result.diffs[name] = (ours - ref).abs().max().item()
    if not result.diffs:
        raise ValueError("the golden file stores no output the replay produces")
    return result
