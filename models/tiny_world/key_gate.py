"""A learned key gate: which held movement keys a world's walls block in the next chunk.

A world model whose DiT follows keys well can still walk through walls: the rule "a key moves the
player unless a wall is in the way" has to be read off a few cells next to the player, and the
tiny world's DiT never learned it (issue 11, model card rows AT-BE). The gate learns exactly that
rule as a small supervised classifier: from the latest latent frame of a session's history it
predicts, per movement key, for how many of the next `horizon` frames holding that key still
moves the player. Before a chunk is generated the runtime turns every held key that would no
longer move into "not held" (`KeyGate.gate`), so the DiT draws a blocked player as it draws an
idle one, which is what the game shows. The gate is part of the model (trained from the game's
recorded episodes, shipped beside the DiT in DIR/gate/); the client's actions are untouched.

With `view` on, a second head predicts, per movement key, for how many of those frames the view
still scrolls with the player before the camera stops at the world's edge, and the gate plans
the chunk's motion (`KeyGate.plan`): frame by frame, a moving player scrolls the view while it
stands at the view's centre and the camera has room, and otherwise walks across the view (the
game's clamped camera). The world pins the view's phase and the player's place of every
generated frame to that plan (`World.pin`), so the DiT draws the terrain and the creatures of a
world whose view and player move by the game's rule: the sampler no longer redraws them from
noise every chunk, where a few tenths of a pixel of bias a chunk walked an idle view and pulled
an off-centre player to the centre (issue 11, model card row BJ).

Input: the latent frame plus the sprite marker (`models.causal_wan.sprite_marker`: where the
player is relative to each cell), a few 3x3 convolutions, a softmax-weighted pool over cells (so
the head can look next to the player wherever it stands), and one linear layer to
(keys, horizon + 1) logits.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.tiny_world.fast_decoder import phase_channels
from models.tiny_world.marker import MarkerConfig, marker_inputs, marker_motion, sprite_marker


@dataclass
class KeyGateConfig:
    """What a key gate reads and predicts."""

    keys: tuple[str, ...]  # the action rows' key columns, in order (the world's action space)
    moves: tuple[tuple[str, int, int], ...]  # (key, axis 0 = x, sign) of each movement key
    in_channels: int  # latent channels
    marker: MarkerConfig  # the latents' sprite marker (the player's place relative to each cell)
    horizon: int = 4  # frames one prediction covers (a chunk)
    width: int = 48  # convolution channels
    layers: int = 4  # 3x3 convolutions
    view: bool = False  # also the view head and the motion plan (`plan`)
    step: int = 1  # view pixels a frame of motion moves (the game's speed)

    def __post_init__(self) -> None:
        unknown = [k for k, _, _ in self.moves if k not in self.keys]
        if unknown:
            raise ValueError(f"gate moves {unknown} are not action keys {list(self.keys)}")
        if self.horizon < 1 or self.layers < 1:
            raise ValueError("a key gate needs horizon >= 1 and layers >= 1")
        if self.step < 1:
            raise ValueError(f"a key gate's step is at least one pixel, not {self.step}")

    def to_dict(self) -> dict:
        """JSON-ready (worldserve.json "gate")."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KeyGateConfig:
        """Inverse of `to_dict`."""
        data = dict(data)
        data["keys"] = tuple(data["keys"])
        data["moves"] = tuple(tuple(m) for m in data["moves"])
        mk = dict(data["marker"])
        mk["mean"], mk["std"] = tuple(mk["mean"]), tuple(mk["std"])
        data["marker"] = MarkerConfig(**mk)
        return cls(**data)


class KeyGate(nn.Module):
    """Latent frames (B, C, h, w) -> per movement key, logits over 0..horizon frames of motion
    (and, with `view`, over 0..horizon frames the view scrolls)."""

    def __init__(self, cfg: KeyGateConfig) -> None:
        super().__init__()
        self.cfg = cfg
        chans = [cfg.in_channels + MarkerConfig.channels] + [cfg.width] * cfg.layers
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in itertools.pairwise(chans))
        self.score = nn.Conv2d(cfg.width, 1, 1)  # where to look: learned from the marker, per cell
        self.out = nn.Linear(cfg.width, len(cfg.moves) * (cfg.horizon + 1))
        if cfg.view:  # its own pool: the world's edge is at the view's border, not next to the player
            self.view_score = nn.Conv2d(cfg.width, 1, 1)
            self.view_out = nn.Linear(cfg.width, len(cfg.moves) * (cfg.horizon + 1))

    def _features(self, z: torch.Tensor) -> torch.Tensor:
        marker = sprite_marker(z[:, :, None], self.cfg.marker)[:, :, 0]
        x = torch.cat([z, marker], dim=1)
        for conv in self.convs:
            x = F.silu(conv(x))
        return x

    def _head(self, x: torch.Tensor, score: nn.Module, out: nn.Module) -> torch.Tensor:
        w = torch.softmax(score(x).flatten(1), dim=1)  # (B, h*w)
        pooled = torch.einsum("bcn,bn->bc", x.flatten(2), w)
        return out(pooled).view(x.shape[0], len(self.cfg.moves), self.cfg.horizon + 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, C, h, w) normalised latents -> logits (B, moves, horizon + 1) of the player's motion."""
        return self._head(self._features(z), self.score, self.out)

    def heads(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """z (B, C, h, w) -> the motion logits and the view's (None without `view`), one pass."""
        x = self._features(z)
        view = self._head(x, self.view_score, self.view_out) if self.cfg.view else None
        return self._head(x, self.score, self.out), view

    @torch.no_grad()
    def rooms(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """z (B, C, h, w) -> (B, moves) int64 frames of motion each key held alone would give and,
        with `view`, (B, moves) frames the view would still scroll; one pass."""
        free, view = self.heads(z)
        return free.argmax(dim=-1), None if view is None else view.argmax(dim=-1)

    def _axes(self) -> list[tuple[int, int, int]]:
        """(axis, index of its + key in `moves`, of its - key) per axis of motion."""
        out = []
        for axis in sorted({a for _, a, _ in self.cfg.moves}):
            plus = [i for i, (_, a, s) in enumerate(self.cfg.moves) if a == axis and s > 0]
            minus = [i for i, (_, a, s) in enumerate(self.cfg.moves) if a == axis and s < 0]
            if len(plus) != 1 or len(minus) != 1:
                raise ValueError(f"axis {axis} needs one key each way, got {plus} and {minus}")
            out.append((axis, plus[0], minus[0]))
        return out

    def _net(self, actions: torch.Tensor, i_plus: int, i_minus: int) -> torch.Tensor:
        """(B, n) int64: per frame, +1 / -1 / 0 as the axis' net held key (opposite keys cancel)."""
        held = [actions[..., self.cfg.keys.index(self.cfg.moves[i][0])] > 0.5 for i in (i_plus, i_minus)]
        return held[0].flatten(2).any(2).long() - held[1].flatten(2).any(2).long()

    @torch.no_grad()
    def gate(self, actions: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """Action rows (B, n, ..., width) of a chunk's frames with every movement key released in
        the frames where it would no longer move the player: `free` (B, moves) frames of motion
        per key from the chunk's start (`rooms`). Per axis, the player's offset from the
        start advances one step per frame its net key (opposite keys cancel, as in the game)
        still has room; a key with none left is released for that frame."""
        out = actions.clone()
        cols = {k: self.cfg.keys.index(k) for k, _, _ in self.cfg.moves}
        for _, ip, im in self._axes():
            kp, km = self.cfg.moves[ip][0], self.cfg.moves[im][0]
            net_all = self._net(actions, ip, im)  # (B, n)
            offset = torch.zeros_like(free[:, 0])  # (B,) frames moved along this axis so far
            for f in range(actions.shape[1]):
                net = net_all[:, f]
                room = torch.where(net > 0, free[:, ip] - offset, free[:, im] + offset)
                stop = (net != 0) & (room <= 0)
                # Masks, not indexing: no device sync inside the chunk loop.
                for col, way in ((cols[kp], net > 0), (cols[km], net < 0)):
                    keep = ~(stop & way)
                    out[:, f, ..., col] *= keep.view(-1, *[1] * (out.dim() - 3)).to(out.dtype)
                offset = offset + torch.where(stop, 0, net)
        return out

    @torch.no_grad()
    def steer(self, actions: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chunk's action rows (B, n, ..., width) from the latest latent frames z (B, C, h, w):
        the rows with every blocked key released (`gate`) and, with `view`, the chunk's planned
        motion (`plan`; None without): one pass of the convolutions (`rooms`)."""
        free, scroll = self.rooms(z)
        gated = self.gate(actions, free)
        return gated, None if scroll is None else self.plan(gated, scroll, z)

    @torch.no_grad()
    def plan(self, actions: torch.Tensor, scroll: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The chunk's motion as pinned latents: (B, 6, n) normalised values of the marker's
        channels (`marker_inputs`: the view's 4 phase channels, then the player's 2 place
        channels) for each of the chunk's n frames, from gated action rows (B, n, ..., width) (`gate`: a held
        key moves the player one step), `scroll` (B, moves) frames the view still scrolls per key
        (`rooms`) and the latest latent frame z (B, C, h, w).

        Per axis and frame, a moving player scrolls the view (its phase moves by `step` px) while
        it stands at the view's centre and the camera has room that way; otherwise, as where
        the game's camera stops at the world's edge, the player walks across the view (its place
        moves by `step` px) and the view stands."""
        mk, step = self.cfg.marker, self.cfg.step
        phase, place = read_motion(z[:, list(marker_inputs(mk))].mean(dim=(2, 3)), mk)  # (B, 2) each
        n, h = actions.shape[1], self.cfg.horizon
        phases = phase[:, :, None].repeat(1, 1, n)  # (B, 2, n)
        places = place[:, :, None].repeat(1, 1, n)
        for axis, ip, im in self._axes():
            net_all = self._net(actions, ip, im)
            room_p, room_m = scroll[:, ip].clone(), scroll[:, im].clone()
            view, own = phase[:, axis].clone(), place[:, axis].clone()
            for f in range(n):
                net = net_all[:, f]
                room = torch.where(net > 0, room_p, room_m)
                scrolls = (net != 0) & (own == 0) & (room > 0)
                way = torch.where(scrolls, net, 0)  # the view's move; the player's otherwise
                view = view + way * step
                own = own + (net - way) * step
                room_p, room_m = (room_p - way).clamp(0, h), (room_m + way).clamp(0, h)
                phases[:, axis, f], places[:, axis, f] = view, own
        b = phases.shape[0]
        cos_sin = phase_channels(phases.transpose(1, 2).reshape(b * n, 2), mk.spatial, (1, 1))
        raw = torch.cat([cos_sin.view(b, n, 4).transpose(1, 2), places / mk.scale], dim=1)  # (B, 6, n)
        mean = torch.tensor(mk.mean, dtype=raw.dtype, device=raw.device)[:, None]
        std = torch.tensor(mk.std, dtype=raw.dtype, device=raw.device)[:, None]
        return (raw - mean) / std


def read_motion(values: torch.Tensor, marker: MarkerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised values (B, 6, ...) of the `marker_inputs` channels -> the view's phase on its
    canvas and the player's offset from the view's centre (B, 2, ...) each, in whole px
    (`marker_motion`, rounded; computed in float32)."""
    phase, place = marker_motion(values.float(), marker)
    return torch.round(phase), torch.round(place)
