"""The key gate stage (`models.tiny_world.key_gate`): its config, its labels (the game's rule on each world's
map, `free_walk`, `camera_room`) and its training, on every episode frame in the served
history's form; `GateStage` is the trainer's `gate` stage."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.game import GameConfig, generate_world
from models.tiny_world import SIZE, atlas_tiles, marker_config
from models.tiny_world.data import KEYS
from models.tiny_world.fast_decoder import SPRITE_SCALE, FastAutoencoder
from models.tiny_world.key_gate import KeyGate, KeyGateConfig, read_motion
from models.tiny_world.marker import marker_inputs
from models.tiny_world.metrics import KEY_AXES
from models.tiny_world.training.targets import on_anchors


def gate_config(ae: FastAutoencoder, horizon: int = 4, view: bool = True) -> KeyGateConfig:
    """The gate of a tile-aligned, sprite-layered, normalised tiny-world autoencoder (`view`: with
    the view head and the motion plan; the game's player moves one pixel a frame)."""
    step = GameConfig().player_speed * GameConfig(size=ae.cfg.frame_size).scale
    if step != int(step):
        raise ValueError(f"the motion plan moves whole pixels, the game's player {step} a frame")
    return KeyGateConfig(
        keys=tuple(KEYS),
        moves=tuple(KEY_AXES),
        in_channels=ae.cfg.latent_channels,
        marker=marker_config(ae.cfg),
        horizon=horizon,
        view=view,
        step=int(step),
    )


def camera_room(cameras: torch.Tensor, horizon: int, config: GameConfig) -> torch.Tensor:
    """(n, 4) int64: per movement key (`KEY_AXES` order), for how many of `horizon` frames the
    camera at `cameras` (n, 2) (the view's top-left corner, frame px) can still follow a player
    walking that way before it stops at the world's edge (`Game.camera`'s clamp)."""
    px = config.scale * config.player_speed
    top = config.world_tiles * config.tile * config.scale - config.size  # the camera's last place
    out = []
    for _, axis, sign in KEY_AXES:
        left = top - cameras[:, axis] if sign > 0 else cameras[:, axis]
        out.append(torch.div(left.double() + 1e-6, px, rounding_mode="floor").long().clamp(0, horizon))
    return torch.stack(out, dim=1)


def free_walk(
    walls: torch.Tensor, episode: torch.Tensor, centres: torch.Tensor, horizon: int, config: GameConfig
) -> torch.Tensor:
    """(n, 4) int64: per movement key (`KEY_AXES` order), for how many of `horizon` frames holding
    it alone moves the player from world centre `centres` (n, 2) (world units) on the map
    `walls[episode]` ((E, T, T) bool tiles, `episode` (n,)): the game's rule (`Game.step`) for a
    player standing free; a player drawn overlapping a wall (a generated frame can show one) walks
    on while the edge it leads with is free, so it cannot walk deeper in but can back out."""
    side, tile, v = config.player_size, config.tile, config.player_speed
    top_left = centres.double() - side / 2.0
    last = walls.shape[-1] - 1
    out = []
    for _, axis, sign in KEY_AXES:
        a, o = top_left[:, axis], top_left[:, 1 - axis]
        o_tiles = [(o / tile).floor(), ((o + side) / tile).ceil() - 1]
        free = torch.full((len(a),), horizon, dtype=torch.long)
        walking = torch.ones(len(a), dtype=torch.bool)
        for j in range(1, horizon + 1):
            # The strip the box's leading edge sweeps in frame j.
            lo, hi = (a + side + (j - 1) * v, a + side + j * v) if sign > 0 else (a - j * v, a - (j - 1) * v)
            hit = torch.zeros(len(a), dtype=torch.bool)
            for at in ((lo / tile).floor(), (hi / tile).ceil() - 1):
                for ot in o_tiles:
                    at_i, ot_i = at.long().clamp(0, last), ot.long().clamp(0, last)
                    x, y = (at_i, ot_i) if axis == 0 else (ot_i, at_i)
                    hit |= walls[episode, y, x]
            free[walking & hit] = j - 1
            walking &= ~hit
        out.append(free)
    return torch.stack(out, dim=1)


def world_centres(cameras: torch.Tensor, players: torch.Tensor, config: GameConfig) -> torch.Tensor:
    """The player's centre in world units from recorded cameras and screen places (frame px)."""
    return (cameras + players).double() / config.scale


def world_walls(seeds: Sequence[int], config: GameConfig) -> torch.Tensor:
    """(E, T, T) bool: the wall tiles of the worlds `seeds`."""
    return torch.stack([torch.from_numpy(generate_world(int(s), config).wall) for s in seeds])


@dataclass
class GateTraining:
    """How a gate is trained (`TrainConfig`'s gate settings; recorded with the gate)."""

    steps: int = 3000  # AdamW steps
    batch: int = 256  # frames per step
    lr: float = 2e-3  # peak learning rate (cosine to 5 %)
    noise: float = 0.1  # std of Gaussian noise on the normalised latents (the model's own are not exact)
    jitter: int = 6  # half the frames show the player moved up to this many px (labels from there)
    held_out: float = 0.05  # share of the episodes (at least one) kept out to report accuracy on
    seed: int = 0


def jitter_player(z: torch.Tensor, sprite: int, offsets: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, h, w) with the sprite layer's centre channels (`sprite`, +1)
    moved by `offsets` (B, 2) view px (raw = normalised there: mean 0, std 1)."""
    out = z.clone()
    out[:, sprite : sprite + 2] += (offsets / SPRITE_SCALE).to(z.dtype)[:, :, None, None]
    return out


def train_gate(
    gate_cfg: KeyGateConfig,
    latents: torch.Tensor,
    walls: torch.Tensor,
    centres: torch.Tensor,
    sprite: int,
    tr: GateTraining,
    config: GameConfig,
    progress: bool = True,
    cameras: torch.Tensor | None = None,
    actions: torch.Tensor | None = None,
) -> tuple[KeyGate, dict]:
    """Train a gate on latents (E, N+1, C, h, w) (canonical, normalised) of episodes on the maps
    `walls` (E, T, T) with the player's world centres `centres` (E, N+1, 2); `sprite` is the
    latents' first sprite-centre channel. Half the frames see the player moved by up to
    `tr.jitter` px (`jitter_player`), labelled from where it is drawn (`free_walk`): a generated
    frame may show it anywhere, also overlapping a wall. A gate with `view` also learns the
    camera's room (`camera_room` of `cameras` (E, N+1, 2), frame px) and is scored on how
    exactly its motion plan follows the episodes' `actions` (E, N+1, width) (`plan_accuracy`).
    The last `held_out` share of the episodes is not trained on; returns the gate and its
    accuracy there (`gate_accuracy`)."""
    if gate_cfg.view and (cameras is None or actions is None):
        raise ValueError("a gate with a view head needs the episodes' cameras and actions")
    torch.manual_seed(tr.seed)
    gen = torch.Generator().manual_seed(tr.seed + 1)
    e_count, n_frames = latents.shape[:2]
    n_train = e_count - max(1, round(e_count * tr.held_out))
    if n_train <= 0:
        raise ValueError(f"{e_count} episode(s): none left to train the gate on beside the held-out one")
    gate = KeyGate(gate_cfg)
    opt = torch.optim.AdamW(gate.parameters(), lr=tr.lr, weight_decay=0.01)
    bar = tqdm(range(tr.steps), desc="key gate", disable=not progress, file=sys.stderr)
    loss_val = float("nan")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = tr.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / max(1, tr.steps - 1))))
        e = torch.randint(0, n_train, (tr.batch,), generator=gen)
        t = torch.randint(0, n_frames, (tr.batch,), generator=gen)
        moved = torch.rand(tr.batch, generator=gen) < 0.5
        offsets = torch.randint(-tr.jitter, tr.jitter + 1, (tr.batch, 2), generator=gen) * moved[:, None]
        z = jitter_player(latents[e, t].float(), sprite, offsets.float())
        z = z + tr.noise * torch.randn(z.shape, generator=gen)
        labels = free_walk(walls, e, centres[e, t] + offsets / config.scale, gate_cfg.horizon, config)
        free, view = gate.heads(z)
        loss = F.cross_entropy(free.flatten(0, 1), labels.flatten())
        if view is not None:
            room = camera_room(cameras[e, t], gate_cfg.horizon, config)
            loss = loss + F.cross_entropy(view.flatten(0, 1), room.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_val = loss.item()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss_val:.4f}")
    gate.eval()
    held = torch.arange(n_train, e_count)
    labels = free_walk(
        walls, held.repeat_interleave(n_frames), centres[held].flatten(0, 1), gate_cfg.horizon, config
    )
    metrics = gate_accuracy(gate, latents[held].flatten(0, 1), labels)
    if gate_cfg.view:
        rooms = camera_room(cameras[held].flatten(0, 1), gate_cfg.horizon, config)
        metrics |= view_accuracy(gate, latents[held].flatten(0, 1), rooms)
        metrics |= plan_accuracy(gate, latents[held], actions[held], cameras[held], centres[held], config)
    return gate, {"final_loss": loss_val, **metrics}


@torch.no_grad()
def gate_accuracy(gate: KeyGate, latents: torch.Tensor, labels: torch.Tensor) -> dict:
    """Accuracy of `gate` on latent frames (n, C, h, w) against their labels (n, moves)."""
    pred = torch.cat([gate.rooms(latents[i : i + 1024].float())[0] for i in range(0, len(latents), 1024)])
    right = pred == labels
    blocked = labels < gate.cfg.horizon
    return {
        "pairs": int(labels.numel()),
        "accuracy": right.float().mean().item(),
        "blocked_pairs": int(blocked.sum()),
        "blocked_accuracy": right[blocked].float().mean().item() if blocked.any() else float("nan"),
        "frame_accuracy": right.all(1).float().mean().item(),
    }


@torch.no_grad()
def view_accuracy(gate: KeyGate, latents: torch.Tensor, rooms: torch.Tensor) -> dict:
    """Accuracy of a view-headed `gate`'s camera room on latent frames (n, C, h, w) against
    `camera_room` labels (n, moves), overall and where the camera is near the world's edge."""
    pred = torch.cat([gate.rooms(latents[i : i + 1024].float())[1] for i in range(0, len(latents), 1024)])
    right = pred == rooms
    edge = rooms < gate.cfg.horizon
    return {
        "view_accuracy": right.float().mean().item(),
        "view_edge_pairs": int(edge.sum()),
        "view_edge_accuracy": right[edge].float().mean().item() if edge.any() else float("nan"),
    }


@torch.no_grad()
def plan_accuracy(
    gate: KeyGate,
    latents: torch.Tensor,
    actions: torch.Tensor,
    cameras: torch.Tensor,
    centres: torch.Tensor,
    config: GameConfig,
) -> dict:
    """How exactly the gate's whole chunk plan (`rooms`, `gate`, `plan`) follows episodes
    (latents (E, N+1, C, h, w), action rows (E, N+1, width), cameras (E, N+1, 2) frame px, the
    player's world centres (E, N+1, 2)): from every chunk start t, the share of the next
    `horizon` frames whose planned view offset and player place are the game's, on both axes,
    overall and in frames where the game's player stands off the view's centre."""
    n = gate.cfg.horizon
    n_frames = latents.shape[1]
    starts = torch.arange(0, n_frames - n, n)
    z = latents[:, starts].flatten(0, 1).float()  # (E*S, C, h, w)
    idx = starts[:, None] + torch.arange(1, n + 1)  # (S, n)
    acts = actions[:, idx].flatten(0, 1)[:, :, None]  # (E*S, n, 1, width)
    _, pins = gate.steer(acts, z)  # (E*S, 6, n)
    phase, place = read_motion(pins, gate.cfg.marker)  # (E*S, 2, n)
    phase0, _ = read_motion(z[:, list(marker_inputs(gate.cfg.marker))].mean(dim=(2, 3)), gate.cfg.marker)
    cams = cameras[:, idx].flatten(0, 1).transpose(1, 2)  # (E*S, 2, n)
    cam0 = cameras[:, starts].flatten(0, 1)[:, :, None]
    screen = centres[:, idx].flatten(0, 1).transpose(1, 2) * config.scale - cams  # player's centre, px
    view_ok = ((phase - phase0[:, :, None]) == (cams - cam0).round()).all(1)
    place_ok = (place == (screen - config.size / 2).round()).all(1)
    ok = view_ok & place_ok
    off = ((screen - config.size / 2).abs() >= 0.5).any(1)
    return {
        "plan_frames": int(ok.numel()),
        "plan_accuracy": ok.float().mean().item(),
        "plan_off_centre_frames": int(off.sum()),
        "plan_off_centre_accuracy": ok[off].float().mean().item() if off.any() else float("nan"),
    }


@torch.no_grad()
def canonical_latents(ae: FastAutoencoder, latents: torch.Tensor, batch: int = 4096) -> torch.Tensor:
    """Latents (E, N+1, C, h, w) in the served history's form (`canonical`, per frame)."""
    flat = latents.flatten(0, 1)
    out = torch.empty_like(flat)
    for i in range(0, flat.shape[0], batch):
        z = flat[i : i + batch].float()[:, :, None]  # (B, C, 1, h, w)
        out[i : i + batch] = ae.canonical(z)[:, :, 0].to(flat.dtype)
    return out.view_as(latents)


class GateStage:
    """The trainer's `gate` stage (a part of `Trainer`)."""

    def train_gate(self) -> bool:
        """The `gate` stage: a key gate (`models.tiny_world.key_gate`) on every episode frame as the served
        history holds it (on its own anchor, `canonical`), labelled by the game's rule on each
        world's map (`free_walk`). Records its held-out accuracy in the log; always finishes."""
        c = self.cfg
        self.stage = "gate"  # also when entered from `init_from` (models/tiny_world/gate.py)
        lat, acts, cams, players = self.latents()
        if cams is None or players is None or not self.ae.cfg.sprite:
            raise SystemExit(
                "the key gate needs tile-aligned latents with a sprite layer, cameras and players"
            )
        t0 = time.monotonic()
        q = self.frame_offsets(cams.numpy()).view(*cams.shape[:2], 2)
        own = torch.cat(  # every frame on its own anchor, 32 episodes at a time
            [
                on_anchors(self.ae, lat[i : i + 32].float(), q[i : i + 32], torch.zeros_like(q[i : i + 32]))
                .transpose(1, 2)
                .half()
                for i in range(0, len(lat), 32)
            ]
        )
        z = canonical_latents(self.ae, own)
        game = GameConfig(size=SIZE)
        walls = world_walls(range(c.world_seed_base, c.world_seed_base + lat.shape[0]), game)
        tr = GateTraining(steps=c.gate_steps, jitter=c.gate_jitter, seed=c.seed)
        gate, record = train_gate(
            gate_config(self.ae),
            z,
            walls,
            world_centres(cams, players, game),
            self.ae.cfg.sprite_slice.start,
            tr,
            game,
            progress=self.progress,
            cameras=cams,
            actions=acts,
        )
        self.gate = gate
        self.log({**record, "seconds": round(time.monotonic() - t0, 1), "t": self.total_elapsed()})
        self.stage = "terrain" if c.terrain_steps > 0 and atlas_tiles(self.gate) else "done"
        self.step = 0
        self.checkpoint()
        return True
