"""The motion stage (`models.tiny_world.motion`): its labels (the recorded episodes' own camera and
player moves), its training and its held-out accuracy; `MotionStage` is the trainer's `motion`
stage.

The game is the data source here, not a rule the head inherits: every label is read off what the
recorded episodes did (`motion_labels`), so the head learns the speed, the walls, the camera's
clamp at the world's edge and which key moves which way from the recordings alone.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.tiny_world import marker_config
from models.tiny_world.data import KEYS
from models.tiny_world.fast_decoder import FastAutoencoder
from models.tiny_world.metrics import KEY_AXES
from models.tiny_world.motion_head import MotionHead, MotionHeadConfig
from models.tiny_world.training.dit import zero_inputs
from models.tiny_world.training.targets import on_anchors


def motion_config(ae: FastAutoencoder, horizon: int = 4) -> MotionHeadConfig:
    """The motion head of a tile-aligned, sprite-layered, normalised tiny-world autoencoder."""
    return MotionHeadConfig(
        keys=tuple(KEYS), in_channels=ae.cfg.latent_channels, marker=marker_config(ae.cfg), horizon=horizon
    )


@dataclass
class MotionLabels:
    """What the episodes did in the `horizon` frames after each chunk start (all (S, ...))."""

    view: torch.Tensor  # (S, n, 2) long: the camera's move into each frame, px
    place: torch.Tensor  # (S, n, 2) long: the player's move in the view into each frame, px
    view_before: torch.Tensor  # (S, n, 2): the camera's move from the start to the frame before
    place_before: torch.Tensor  # (S, n, 2): the player's likewise
    effective: torch.Tensor  # (S, n, keys) float: the key did something in that frame
    keys: torch.Tensor  # (S, n, keys) float: the keys held in that frame


def widen_head(head: MotionHead, channels: int) -> MotionHead:
    """A copy of `head` over latents with `channels` (more than its own, the new ones last) that
    reads the new channels with zero weights: it plans exactly as `head` does."""
    old = head.cfg.in_channels
    if channels <= old:
        raise ValueError(f"cannot widen a motion head of {old} latent channels to {channels}")
    out = MotionHead(replace(head.cfg, in_channels=channels))
    state = dict(head.state_dict())
    # (width, C + marker, 3, 3): the new channels before the marker's
    state["convs.0.weight"] = zero_inputs(state["convs.0.weight"], old, channels - old)
    out.load_state_dict(state)
    return out


def motion_labels(
    actions: torch.Tensor, cameras: torch.Tensor, players: torch.Tensor, n: int
) -> MotionLabels:
    """Labels for chunk starts (S,) from their next `n` frames: action rows (S, n + 1, keys) and
    cameras / players' screen places (S, n + 1, 2) px of the start frame and those after it. A
    movement key took effect where the player moved its way in the world (`KEY_AXES` names the
    keys' directions: training data only); any other key where it was held."""
    view = (cameras[:, 1:] - cameras[:, :-1]).round().long()
    place = (players[:, 1:] - players[:, :-1]).round().long()
    world = (cameras + players).double()
    moved = world[:, 1:] - world[:, :-1]  # (S, n, 2)
    keys = actions[:, 1:].float()
    effective = keys.clone()
    for key, axis, sign in KEY_AXES:
        col = KEYS.index(key)
        effective[..., col] = keys[..., col] * (moved[..., axis] * sign > 0.5).float()
    zero = torch.zeros_like(view[:, :1])
    return MotionLabels(
        view=view,
        place=place,
        view_before=torch.cat([zero, view.cumsum(1)[:, :-1]], 1),
        place_before=torch.cat([zero, place.cumsum(1)[:, :-1]], 1),
        effective=effective,
        keys=keys,
    )


@dataclass
class MotionTraining:
    """How a motion head is trained (recorded with it)."""

    steps: int = 3000  # AdamW steps
    batch: int = 256  # chunk starts per step
    lr: float = 2e-3  # peak learning rate (cosine to 5 %)
    noise: float = 0.1  # std of Gaussian noise on the normalised latents (the model's own are not exact)
    held_out: float = 0.05  # share of the episodes (at least one) kept out to report accuracy on
    seed: int = 0


def head_loss(head: MotionHead, z: torch.Tensor, lab: MotionLabels) -> torch.Tensor:
    """Teacher-forced loss over a batch's chunk frames: cross-entropy of the view's and the
    player's moves, binary cross-entropy of the held keys' effect."""
    ctx, place = head.context(z)
    m = head.cfg.max_step
    total = z.new_zeros(())
    for f in range(lab.view.shape[1]):
        lv, lp, le = head.step(
            ctx, place, lab.keys[:, f], lab.view_before[:, f].float(), lab.place_before[:, f].float()
        )
        total = total + F.cross_entropy(lv.flatten(0, 1), (lab.view[:, f].clamp(-m, m) + m).flatten())
        total = total + F.cross_entropy(lp.flatten(0, 1), (lab.place[:, f].clamp(-m, m) + m).flatten())
        held = lab.keys[:, f] > 0.5
        if held.any():
            total = total + F.binary_cross_entropy_with_logits(le[held], lab.effective[:, f][held])
    return total / lab.view.shape[1]


def chunk_batch(
    latents: torch.Tensor,
    actions: torch.Tensor,
    cameras: torch.Tensor,
    players: torch.Tensor,
    e: torch.Tensor,
    t: torch.Tensor,
    n: int,
) -> tuple[torch.Tensor, MotionLabels]:
    """The latest frames (B, C, h, w) at chunk starts (episode e, frame t) and their labels."""
    idx = t[:, None] + torch.arange(n + 1)  # (B, n + 1)
    lab = motion_labels(
        actions[e[:, None], idx][..., : len(KEYS)],
        cameras[e[:, None], idx].float(),
        players[e[:, None], idx].float(),
        n,
    )
    return latents[e, t].float(), lab


def train_motion(
    cfg: MotionHeadConfig,
    latents: torch.Tensor,
    actions: torch.Tensor,
    cameras: torch.Tensor,
    players: torch.Tensor,
    tr: MotionTraining,
    progress: bool = True,
) -> tuple[MotionHead, dict]:
    """Train a head on episodes: canonical normalised latents (E, N+1, C, h, w), action rows,
    cameras and the players' screen places (E, N+1, 2) px. The last `held_out` share of the
    episodes is not trained on; returns the head and its accuracy there (`motion_accuracy`)."""
    torch.manual_seed(tr.seed)
    gen = torch.Generator().manual_seed(tr.seed + 1)
    e_count, n_frames = latents.shape[:2]
    n_train = e_count - max(1, round(e_count * tr.held_out))
    if n_train <= 0:
        raise ValueError(
            f"{e_count} episode(s): none left to train the motion head on beside the held-out one"
        )
    head = MotionHead(cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=tr.lr, weight_decay=0.01)
    bar = tqdm(range(tr.steps), desc="motion head", disable=not progress, file=sys.stderr)
    loss_val = float("nan")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = tr.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / max(1, tr.steps - 1))))
        e = torch.randint(0, n_train, (tr.batch,), generator=gen)
        t = torch.randint(0, n_frames - cfg.horizon, (tr.batch,), generator=gen)
        z, lab = chunk_batch(latents, actions, cameras, players, e, t, cfg.horizon)
        z = z + tr.noise * torch.randn(z.shape, generator=gen)
        loss = head_loss(head, z, lab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_val = loss.item()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss_val:.4f}")
    head.eval()
    held = torch.arange(n_train, e_count)
    metrics = motion_accuracy(head, latents[held], actions[held], cameras[held], players[held])
    return head, {"final_loss": loss_val, **metrics}


@torch.no_grad()
def motion_accuracy(
    head: MotionHead,
    latents: torch.Tensor,
    actions: torch.Tensor,
    cameras: torch.Tensor,
    players: torch.Tensor,
) -> dict:
    """How exactly the head's rolled-out chunk plans (`MotionHead.roll`, each frame reading its
    own earlier predictions) follow episodes: from every chunk start, the share of frames whose
    view offset and player place are the recording's on both axes, overall, in frames with a
    key held that moved nothing (walls; the camera at the world's edge moves the player only),
    and where the player stands off the view's centre."""
    n = head.cfg.horizon
    starts = torch.arange(0, latents.shape[1] - n, n)
    e = torch.arange(latents.shape[0]).repeat_interleave(len(starts))
    t = starts.repeat(latents.shape[0])
    z, lab = chunk_batch(latents, actions, cameras, players, e, t, n)
    views, places = [], []
    for i in range(0, len(z), 2048):
        plan = head.roll(z[i : i + 2048], lab.keys[i : i + 2048])
        views.append(plan.view)
        places.append(plan.place)
    view, place = torch.cat(views).transpose(1, 2), torch.cat(places).transpose(1, 2)  # (S, n, 2)
    ok = ((view == lab.view.cumsum(1)) & (place == lab.place.cumsum(1))).all(-1)  # (S, n)
    moving = lab.keys[..., [KEYS.index(k) for k, _, _ in KEY_AXES]].amax(-1) > 0.5
    blocked = moving & (lab.effective[..., [KEYS.index(k) for k, _, _ in KEY_AXES]].amax(-1) < 0.5)
    screen = players[e[:, None], t[:, None] + torch.arange(1, n + 1)].float()
    off = ((screen - head.cfg.marker.frame_size / 2).abs() >= 0.5).any(-1)

    def share(mask: torch.Tensor) -> float:
        return ok[mask].float().mean().item() if mask.any() else float("nan")

    return {
        "plan_frames": int(ok.numel()),
        "plan_accuracy": ok.float().mean().item(),
        "plan_moving_accuracy": share(moving),
        "plan_blocked_frames": int(blocked.sum()),
        "plan_blocked_accuracy": share(blocked),
        "plan_off_centre_frames": int(off.sum()),
        "plan_off_centre_accuracy": share(off),
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


class MotionStage:
    """The trainer's `motion` stage (a part of `Trainer`)."""

    def served_latents(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every episode frame as the served history holds it (on its own anchor, `canonical`),
        with the action rows, cameras and players' screen places."""
        lat, acts, cams, players = self.latents()
        if cams is None or players is None or not self.ae.cfg.sprite:
            raise SystemExit(
                "the motion head needs tile-aligned latents with a sprite layer, cameras and players"
            )
        q = self.frame_offsets(cams.numpy()).view(*cams.shape[:2], 2)
        own = torch.cat(  # every frame on its own anchor, 32 episodes at a time
            [
                on_anchors(self.ae, lat[i : i + 32].float(), q[i : i + 32], torch.zeros_like(q[i : i + 32]))
                .transpose(1, 2)
                .half()
                for i in range(0, len(lat), 32)
            ]
        )
        return canonical_latents(self.ae, own), acts, cams, players

    def train_motion(self) -> bool:
        """The `motion` stage: a motion head (`models.tiny_world.motion`) on every episode chunk as
        the served history holds it, labelled by what the episodes did. Records its held-out
        accuracy in the log; always finishes."""
        c = self.cfg
        self.stage = "motion"  # also when entered from `init_from` (models/tiny_world/motion.py)
        t0 = time.monotonic()
        z, acts, cams, players = self.served_latents()
        tr = MotionTraining(steps=c.motion_steps, seed=c.seed)
        head, record = train_motion(
            motion_config(self.ae), z, acts, cams, players, tr, progress=self.progress
        )
        self.motion = head
        self.log({**record, "seconds": round(time.monotonic() - t0, 1), "t": self.total_elapsed()})
        self.stage = "terrain" if c.terrain_steps > 0 else "done"
        self.step = 0
        self.checkpoint()
        return True
