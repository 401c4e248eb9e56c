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

from models.causal_wan import MarkerConfig, sprite_marker


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

    def __post_init__(self) -> None:
        unknown = [k for k, _, _ in self.moves if k not in self.keys]
        if unknown:
            raise ValueError(f"gate moves {unknown} are not action keys {list(self.keys)}")
        if self.horizon < 1 or self.layers < 1:
            raise ValueError("a key gate needs horizon >= 1 and layers >= 1")

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
    """Latent frames (B, C, h, w) -> per movement key, logits over 0..horizon frames of motion."""

    def __init__(self, cfg: KeyGateConfig) -> None:
        super().__init__()
        self.cfg = cfg
        chans = [cfg.in_channels + MarkerConfig.channels] + [cfg.width] * cfg.layers
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in itertools.pairwise(chans))
        self.score = nn.Conv2d(cfg.width, 1, 1)  # where to look: learned from the marker, per cell
        self.out = nn.Linear(cfg.width, len(cfg.moves) * (cfg.horizon + 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, C, h, w) normalised latents -> logits (B, moves, horizon + 1)."""
        marker = sprite_marker(z[:, :, None], self.cfg.marker)[:, :, 0]
        x = torch.cat([z, marker], dim=1)
        for conv in self.convs:
            x = F.silu(conv(x))
        w = torch.softmax(self.score(x).flatten(1), dim=1)  # (B, h*w)
        pooled = torch.einsum("bcn,bn->bc", x.flatten(2), w)
        return self.out(pooled).view(z.shape[0], len(self.cfg.moves), self.cfg.horizon + 1)

    @torch.no_grad()
    def free_frames(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, C, h, w) -> (B, moves) int64: frames of motion each key held alone would give."""
        return self(z).argmax(dim=-1)

    @torch.no_grad()
    def gate(self, actions: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """Action rows (B, n, ..., width) of a chunk's frames with every movement key released in
        the frames where it would no longer move the player: `free` (B, moves) frames of motion
        per key from the chunk's start (`free_frames`). Per axis, the player's offset from the
        start advances one step per frame its net key (opposite keys cancel, as in the game)
        still has room; a key with none left is released for that frame."""
        out = actions.clone()
        cols = {k: self.cfg.keys.index(k) for k, _, _ in self.cfg.moves}
        for axis in sorted({a for _, a, _ in self.cfg.moves}):
            plus = [(i, k) for i, (k, a, s) in enumerate(self.cfg.moves) if a == axis and s > 0]
            minus = [(i, k) for i, (k, a, s) in enumerate(self.cfg.moves) if a == axis and s < 0]
            if len(plus) != 1 or len(minus) != 1:
                raise ValueError(f"axis {axis} needs one key each way, got {plus} and {minus}")
            (ip, kp), (im, km) = plus[0], minus[0]
            held_p = actions[..., cols[kp]] > 0.5  # (B, n, ...)
            held_m = actions[..., cols[km]] > 0.5
            offset = torch.zeros_like(free[:, 0])  # (B,) frames moved along this axis so far
            for f in range(actions.shape[1]):
                net = held_p[:, f].flatten(1).any(1).long() - held_m[:, f].flatten(1).any(1).long()
                room = torch.where(net > 0, free[:, ip] - offset, free[:, im] + offset)
                stop = (net != 0) & (room <= 0)
                # Masks, not indexing: no device sync inside the chunk loop.
                for col, way in ((cols[kp], net > 0), (cols[km], net < 0)):
                    keep = ~(stop & way)
                    out[:, f, ..., col] *= keep.view(-1, *[1] * (out.dim() - 3)).to(out.dtype)
                offset = offset + torch.where(stop, 0, net)
        return out
