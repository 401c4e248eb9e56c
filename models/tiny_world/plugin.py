"""The tiny world's plug-in (`models.plugin.WorldPlugin`): its motion head, carried channels and atlas.

What the built-in world adds to the shared DiT, decoder and schedule, all optional and all
learned networks or generic machinery (no rule of the game it was trained on):

* carried channels (`TinyWorldSettings.carry_channels`): the sampler's noise of those latent
  channels is the history's latest frame (the player's place and the view's phase: the DiT was
  trained to move them from where they were);
* a motion head (`MotionHead`): from the latest frame and the chunk's keys it predicts how the
  view and the player move in each frame; the keys it finds without effect are released before
  the DiT sees them, and the motion is written into every clean estimate (`Pins`);
* an atlas (`atlas_tiles` > 0 with a motion head): sessions keep the tiles they have shown, filed
  by the head's predicted pose, and draw the remembered ones when they come back into view, and
  optionally a learned terrain prior for new tiles. The atlas knows no game constant: tiles are
  named by the autoencoder's codebook, fit on training frames, and the world's size and walls
  are the models' to draw (a worldserve.json with the former "world_tiles" or "wall_rgb",
  hand-written game rules, fails to load);
* a creature head (`CreatureHead`, with a motion head, a terrain prior and a creature layer):
  from the latest frames' creature layers and terrain it walks every creature through the chunk,
  meets new ones in the tiles the terrain prior draws and lets others walk onto the canvas, and
  the atlas gives back the creatures it remembers where their tiles come back onto the canvas;
  the result is written into the creature channels of every clean estimate (`Pins`).

A session's state (`TinyState`) is its latest latent frame, the creature layers of the frames
before it (with a creature head) and its atlas. worldserve.json keeps the settings in one block,
the heads' and the terrain prior's configs inside it::

    "plugin": {"name": "tiny_world", "carry_channels": [...], "atlas_tiles": 64,
               "motion": MotionHeadConfig, "terrain": TerrainPriorConfig,
               "creatures": CreatureHeadConfig}   (all three optional)

with the weights at DIR/motion/motion_head.safetensors, DIR/terrain/terrain_prior.safetensors
and DIR/creatures/creature_head.safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from models.plugin import ChunkPlan, WorldPlugin
from models.tiny_world import atlas_tiles
from models.tiny_world.atlas import Atlas, Cartographer, fingerprint
from models.tiny_world.creature_head import CreatureHead, CreatureHeadConfig, clean_layers
from models.tiny_world.fast_decoder import creature_channels
from models.tiny_world.marker import marker_inputs, marker_motion
from models.tiny_world.motion_head import MotionHead, MotionHeadConfig
from models.tiny_world.sampling import carry, pin
from models.tiny_world.terrain_prior import TerrainPrior, TerrainPriorConfig

if TYPE_CHECKING:
    from models.world import World

NAME = "tiny_world"  # worldserve.json "plugin.name"
MOTION_WEIGHTS = "motion/motion_head.safetensors"  # the motion head, relative to the model directory
TERRAIN_WEIGHTS = "terrain/terrain_prior.safetensors"  # the terrain prior, likewise
CREATURE_WEIGHTS = "creatures/creature_head.safetensors"  # the creature head, likewise
# Settings of older model directories that copied the game's rules into the serving path: a
# directory that still has one fails to load (`TinyWorldSettings.from_dict`) rather than serve
# without the behaviour it was measured with.
REMOVED = {
    "world_tiles": "the game's world size, which stopped the camera at its edge",
    "wall_rgb": "the game's border wall colours, pinned around its edge",
}


@dataclass
class TinyWorldSettings:
    """The plug-in's serving settings (worldserve.json "plugin", less "name", "motion", "terrain")."""

    # Latent channels whose sampler noise is the history's latest frame instead of a random draw.
    carry_channels: tuple[int, ...] = ()
    # > 0: sessions keep a map of the tiles they have shown, this many tiles across (`Atlas`);
    # needs tile-aligned latents and a motion head (its predicted pose files the tiles). 0: none.
    atlas_tiles: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TinyWorldSettings:
        """Inverse of `to_dict`; ValueError naming a removed setting (`REMOVED`) that `data` has."""
        removed = sorted(REMOVED.keys() & data.keys())
        if removed:
            why = "; ".join(f"{k!r}: {REMOVED[k]}" for k in removed)
            raise ValueError(
                f"plugin settings {removed} were removed (hand-written game rules, not learned; "
                f'issue 41): delete them from worldserve.json\'s "plugin" block ({why})'
            )
        return cls(
            carry_channels=tuple(data.get("carry_channels", ())),
            atlas_tiles=int(data.get("atlas_tiles", 0)),
        )


@dataclass(frozen=True)
class TinyState:
    """One session's state: its latest committed latent frame, its atlas (None: keeps none) and,
    with a creature head, the creature channels of the frames before the latest (None: none)."""

    last: torch.Tensor  # (C, 1, h, w) in canonical form
    atlas: Atlas | None = None
    trail: torch.Tensor | None = None  # (3, lags - 1, h, w) normalised, on `last`'s anchor, oldest first

    @property
    def nbytes(self) -> int:
        """Device bytes of the frame, the trail and the atlas."""
        own = sum(t.numel() * t.element_size() for t in (self.last, self.trail) if t is not None)
        return own + (self.atlas.nbytes if self.atlas is not None else 0)


@dataclass
class Pins:
    """Latent channels a chunk's frames are known to hold before it is sampled (`plan`): written
    into every clean estimate (`apply`), so the DiT draws the rest of the frame around them."""

    channels: tuple[int, ...]
    values: torch.Tensor  # (B, len(channels), n) normalised, the same in every cell of a frame
    rows: torch.Tensor  # (B,) bool: the entries that have a plan (others keep their own estimate)
    # Remembered tiles (sessions with an atlas): the cell channels (B, k, n, h, w) normalised, and
    # where they hold (B, 1, n, h, w) bool.
    cells: torch.Tensor | None = None
    cell_mask: torch.Tensor | None = None
    # Sessions with a creature head: the creature channels (B, 3, n, h, w) normalised, every cell
    # of every frame (`creature_slice` names them), written in the entries that have a plan.
    creatures: torch.Tensor | None = None
    creature_slice: slice = field(default_factory=lambda: slice(0))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, n, h, w) with the channels set to their values in the entries that have
        a plan and the remembered tiles set where they hold (in place; returned)."""
        pin(x, self.channels, self.values, self.rows)
        b = x.shape[0]
        if self.cells is not None and self.cell_mask is not None:
            k = self.cells.shape[1]
            x[:, :k] = torch.where(self.cell_mask[:b], self.cells[:b].to(x.dtype), x[:, :k])
        if self.creatures is not None:
            cs, rows = self.creature_slice, self.rows[:b, None, None, None, None]
            x[:, cs] = torch.where(rows, self.creatures[:b].to(x.dtype), x[:, cs])
        return x


@dataclass
class TinyWorldPlugin(WorldPlugin):
    """The tiny world's behaviour behind the seam (see the module docstring)."""

    name = NAME
    settings: TinyWorldSettings = field(default_factory=TinyWorldSettings)
    motion: MotionHead | None = None  # plans each chunk's motion (None: the DiT draws it)
    terrain: TerrainPrior | None = None  # draws the tiles sessions show for the first time
    creatures: CreatureHead | None = None  # walks the creatures and meets new ones (None: the DiT moves them)
    # Set by `bind`: writes and reads sessions' atlases (None: no atlas), the world's dtype.
    cartographer: Cartographer | None = field(default=None, init=False)
    dtype: torch.dtype = field(default=torch.float32, init=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"), init=False)
    latent_shape: tuple[int, int, int] = field(default=(0, 0, 0), init=False)
    # Set by `bind` with a creature head: where the creature channels lie and their normalisation.
    creature_slice: slice = field(default_factory=lambda: slice(0), init=False)
    creature_norm: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)

    def bind(self, world: World) -> None:
        """Check the settings, motion head and prior against `world`; move them to its device and dtype."""
        s = self.settings
        channels = world.latent_shape[0]
        bad = [c for c in s.carry_channels if not 0 <= c < channels]
        if bad:
            raise ValueError(f"carry_channels {bad} are not latent channels (0..{channels - 1})")
        self.device, self.dtype, self.latent_shape = world.device, world.dtype, world.latent_shape
        if self.motion is not None:
            keys, read = tuple(world.action_space.keys), tuple(self.motion.cfg.keys)
            if read != keys:
                raise ValueError(f"motion head reads keys {list(read)}, the world's are {list(keys)}")
            if self.motion.cfg.in_channels != channels:
                read_c = self.motion.cfg.in_channels
                raise ValueError(f"motion head reads {read_c} latent channels, the DiT makes {channels}")
            self.motion = self.motion.to(device=self.device, dtype=self.dtype).eval()
        self.cartographer = None
        if s.atlas_tiles > 0:
            ae = getattr(world.decoder, "ae", None)
            if ae is None or not ae.cfg.frame_size:
                raise ValueError("atlas_tiles needs a decoder on tile-aligned latents")
            self.cartographer = Cartographer(ae, s.atlas_tiles)
        if self.terrain is not None:
            if self.cartographer is None:
                raise ValueError("a terrain prior needs an atlas (atlas_tiles > 0)")
            self.terrain = self.terrain.to(device=self.device, dtype=self.dtype).eval()
            self.cartographer.set_prior(self.terrain)
        if self.creatures is not None:
            self.bind_creatures(world)

    def bind_creatures(self, world: World) -> None:
        """`bind`'s checks of the creature head against `world`'s autoencoder."""
        assert self.creatures is not None
        ae = getattr(world.decoder, "ae", None)
        if ae is None or not ae.cfg.creatures:
            raise ValueError("a creature head needs a decoder with a creature layer")
        if self.motion is None or self.terrain is None:
            raise ValueError(
                "a creature head needs a motion head and a terrain prior (it walks the chunks the motion "
                "head plans and meets creatures in the tiles the prior draws)"
            )
        chunk = world.chunk_frames
        if chunk > self.creatures.cfg.horizon:
            raise ValueError(f"creature head walks {self.creatures.cfg.horizon} frames, a chunk has {chunk}")
        hc, ac = self.creatures.cfg, ae.cfg
        if (hc.cell_channels, hc.spatial, hc.classes) != (ac.cell_channels, ac.spatial, len(ac.codebook)):
            raise ValueError(
                f"creature head reads {hc.cell_channels} cell channels of {hc.spatial} px tiles in "
                f"{hc.classes} classes; the autoencoder has {ac.cell_channels}, {ac.spatial}, "
                f"{len(ac.codebook)}"
            )
        self.creatures = self.creatures.to(device=self.device, dtype=self.dtype).eval()
        cs = ac.creature_slice
        self.creature_slice = cs
        self.creature_norm = (ae.latents_mean[cs].to(self.device), ae.latents_std[cs].to(self.device))

    # -- description ----------------------------------------------------------------------------

    @property
    def keeps_last(self) -> bool:
        """Whether sessions keep their latest latent frame: read by `noise` and `plan`."""
        return bool(self.settings.carry_channels) or self.motion is not None or self.creatures is not None

    @property
    def remembers(self) -> bool:
        """Whether sessions keep an atlas: `atlas_tiles` > 0 and a motion head."""
        return self.cartographer is not None and self.motion is not None

    def state_bytes(self) -> int:
        """Bytes of one atlas version where sessions remember and of the creature trail (the
        latest frame is not counted)."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        trail = 0
        if self.creatures is not None:
            _, h, w = self.latent_shape
            trail = 3 * (self.creatures.cfg.lags - 1) * h * w * item
        if not self.remembers:
            return trail
        assert self.cartographer is not None
        return self.cartographer.nbytes(item) + trail

    # -- hooks ----------------------------------------------------------------------------------

    @torch.no_grad()
    def start(self, latents: torch.Tensor) -> TinyState | None:
        """The state after the start latents (C, n, h, w): their last frame, a new atlas there."""
        if not self.keeps_last:
            return None
        last = latents[:, -1:]
        atlas = self.cartographer.start(last) if self.remembers and self.cartographer is not None else None
        return TinyState(last, atlas, self.trail(latents[None])[0] if self.creatures is not None else None)

    def trail(self, z: torch.Tensor) -> torch.Tensor:
        """(B, 3, lags - 1, h, w): the creature channels of the frames before the last of
        committed latents z (B, C, n, h, w), all on the last's anchor (`canonical` puts a chunk
        there); where z has too few, its first frame stands in for the earlier ones."""
        assert self.creatures is not None
        k = self.creatures.cfg.lags - 1
        before = z[:, self.creature_slice, :-1]
        if before.shape[2] < k:
            first = z[:, self.creature_slice, :1]
            before = torch.cat([first.expand(-1, -1, k - before.shape[2], -1, -1), before], dim=2)
        return before[:, :, -k:].clone()

    @torch.no_grad()
    def noise(self, noise: torch.Tensor, states: Sequence[TinyState | None]) -> torch.Tensor:  # type: ignore[override]
        """The noise (B, C, n, h, w) with `carry_channels` of entry i set to its latest frame
        (`sampling.carry`); entries without a state keep their draw."""
        for i, st in enumerate(states):
            if st is not None:
                carry(noise[i : i + 1], st.last[None], self.settings.carry_channels)
        return noise

    def plan(self, actions: torch.Tensor | None, states: Sequence[TinyState | None]) -> ChunkPlan:  # type: ignore[override]
        """The chunk's actions and pins (`steer`)."""
        out, pins = self.steer(actions, states)
        return ChunkPlan(out, None if pins is None else pins.apply)

    @torch.no_grad()
    def steer(
        self, actions: torch.Tensor | None, states: Sequence[TinyState | None]
    ) -> tuple[torch.Tensor | None, Pins | None]:
        """The chunk's action rows with each held key the motion head finds without effect from
        entry i's latest frame released, and `Pins` with the head's planned motion
        (`MotionHead.steer`) and, where sessions remember, the tiles entry i's atlas holds in
        its frames' views (`Cartographer.recall`). Entries without a state keep their actions and
        have no plan."""
        rows = [i for i, st in enumerate(states) if st is not None]
        if self.motion is None or actions is None or not rows:
            return actions, None
        z = torch.stack([states[i].last[:, -1] for i in rows]).to(self.device, self.dtype)  # type: ignore[union-attr]
        gated, plan = self.motion.steer(actions[rows], z)  # plan: (k, 6, n)
        out = actions.clone()
        out[rows] = gated.to(actions.dtype)
        values = plan.new_zeros(actions.shape[0], *plan.shape[1:])
        values[rows] = plan
        mask = torch.zeros(actions.shape[0], dtype=torch.bool)
        mask[rows] = True
        marker = self.motion.cfg.marker
        pins = Pins(marker_inputs(marker), values.to(self.dtype), mask.to(self.device))
        carto = self.cartographer
        mapped = [j for j, i in enumerate(rows) if states[i].atlas is not None]  # type: ignore[union-attr]
        if carto is None or not mapped:
            return out, pins
        ids = [rows[j] for j in mapped]
        batch = Atlas.stack([states[i].atlas for i in ids])  # type: ignore[misc,union-attr]
        lasts = torch.stack([states[i].last for i in ids])  # type: ignore[union-attr]
        phases = torch.round(marker_motion(plan[mapped].float(), marker)[0]).long()  # (m, 2, n) px
        b, n, hw = actions.shape[0], plan.shape[2], self.latent_shape[1:]
        cells = torch.zeros(b, carto.k, n, *hw, dtype=self.dtype, device=self.device)
        cell_mask = torch.zeros(b, 1, n, *hw, dtype=torch.bool, device=self.device)
        drawn = torch.full((b, *hw), -1, dtype=torch.long, device=self.device)
        cells[ids], cell_mask[ids], drawn[ids] = carto.recall(batch, lasts, phases)
        pins = replace(pins, cells=cells, cell_mask=cell_mask)
        if self.creatures is None:
            return out, pins
        salts = torch.zeros(b, dtype=torch.long, device=self.device)
        salts[ids] = batch.salt
        places = torch.zeros(b, 2, *hw, dtype=torch.long, device=self.device)
        places[ids] = carto.slots(batch.origin)[0]
        back = torch.zeros(b, *hw, dtype=torch.bool, device=self.device)
        back_at = torch.zeros(b, 2, *hw, dtype=torch.long, device=self.device)
        back[ids], back_at[ids] = carto.remembered(batch, lasts)
        return out, replace(pins, **self.walk(states, rows, n, drawn, places, salts, (back, back_at)))

    @torch.no_grad()
    def walk(
        self,
        states: Sequence[TinyState | None],
        rows: list[int],
        n: int,
        drawn: torch.Tensor,
        places: torch.Tensor,
        salts: torch.Tensor,
        back: tuple[torch.Tensor, torch.Tensor],
    ) -> dict[str, Any]:
        """`Pins` fields with the creature channels (B, 3, n, h, w) of a chunk of `n` frames:
        entry i's creatures (i in `rows`) walked on by the creature head from its latest frames
        (`CreatureHead.walk`), and in every frame those its atlas brings back onto the canvas
        (`back`: `Cartographer.remembered`), those it meets in the tiles drawn this chunk
        (`drawn`, with their `places` and the sessions' `salts`: `CreatureHead.born`) and those
        that walk onto its canvas (`CreatureHead.enter`, drawn by a hash of its latest frame)."""
        assert self.creatures is not None and self.creature_norm is not None
        head, cs, (mean, std) = self.creatures, self.creature_slice, self.creature_norm
        s, b = head.cfg.spatial, drawn.shape[0]
        lasts = torch.stack([states[i].last for i in rows]).to(self.device, self.dtype)  # type: ignore[union-attr]
        trails = torch.stack([self.state_trail(states[i]) for i in rows])  # type: ignore[arg-type]
        recent = torch.cat([trails, lasts[:, cs]], dim=2).transpose(1, 2)  # (m, lags, 3, h, w)
        layers = clean_layers(recent * std + mean, s)
        present, offsets = head.walk(lasts[:, : head.cfg.cell_channels, 0], layers, n)
        hashes = torch.stack([fingerprint(states[i].last) for i in rows]).to(self.device)  # type: ignore[union-attr]
        remembered = (back[0][rows], back[1][rows])
        for met, where in (remembered, head.born(drawn[rows], places[rows], salts[rows]), head.enter(hashes)):
            new = met[:, None] & ~present
            present = present | new
            offsets = torch.where(new[:, :, None], where[:, None], offsets)
        m, g = len(rows), present.shape[-1]
        raw = creature_channels(present.flatten(0, 1), offsets.flatten(0, 1), s).view(m, n, 3, g, g)
        values = torch.zeros(b, 3, n, g, g, dtype=self.dtype, device=self.device)
        values[rows] = ((raw.transpose(1, 2).to(self.dtype) - mean) / std).to(self.dtype)
        return {"creatures": values, "creature_slice": cs}

    def state_trail(self, state: TinyState) -> torch.Tensor:
        """`state`'s trail (3, lags - 1, h, w); a state without one (a snapshot written before
        creature heads) has its latest frame's creatures standing in."""
        if state.trail is not None:
            return state.trail.to(self.device, self.dtype)
        return self.trail(state.last[None].to(self.device, self.dtype))[0]

    @torch.no_grad()
    def advance(
        self,
        raw: torch.Tensor,
        shown: torch.Tensor,
        states: Sequence[TinyState | None],  # type: ignore[override]
        entries: Sequence[int],
    ) -> dict[int, TinyState]:
        """Entry i's latest frame of `shown` and, where sessions remember, its atlas with that
        frame written where `raw`'s anchor moved (`Cartographer.moves`, `Cartographer.write`) and
        the creatures of `raw`'s last frame filed (`Cartographer.file_creatures`)."""
        if not self.keeps_last:
            return {}
        carto = self.cartographer if self.remembers else None
        moved = carto.moves(raw) if carto is not None else None
        tails = shown[:, :, -1:].clone()  # one copy for the batch; each entry keeps its row
        trails = self.trail(shown) if self.creatures is not None else None
        out = {}
        for i in entries:
            atlas = None
            if carto is not None and moved is not None:
                old = states[i].atlas if i < len(states) and states[i] is not None else None  # type: ignore[union-attr]
                if old is None:
                    atlas = carto.start(tails[i])
                else:
                    # Creatures are filed on the canvas the chunk was drawn on, before `canonical`
                    # moves it and drops the cells that fall off.
                    atlas = carto.write(carto.file_creatures(old, raw[i, :, -1:]), moved[i], tails[i])
            out[i] = TinyState(tails[i], atlas, None if trails is None else trails[i])
        return out

    def state_to_tensors(self, state: TinyState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:  # type: ignore[override]
        """The latest frame under "last", the creature trail under "trail" and the atlas's
        fields under "atlas.<field>"."""
        tensors = {"last": state.last.contiguous()}
        if state.trail is not None:
            tensors["trail"] = state.trail.contiguous()
        if state.atlas is not None:
            tensors |= {f"atlas.{f.name}": getattr(state.atlas, f.name).contiguous() for f in fields(Atlas)}
        return tensors, {"atlas": state.atlas is not None}

    def state_from_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> TinyState:
        """Inverse of `state_to_tensors` on this plug-in's device (the frame in its dtype, the
        atlas's tensors as written); ValueError when the shapes do not fit the world."""
        last = tensors.get("last")
        c, h, w = self.latent_shape
        if last is None or tuple(last.shape) != (c, 1, h, w):
            got = None if last is None else tuple(last.shape)
            raise ValueError(f"plug-in state: latest frame {got} is not ({c}, 1, {h}, {w})")
        atlas = None
        if meta.get("atlas"):
            if not self.remembers:
                raise ValueError("plug-in state has an atlas; this world keeps none")
            assert self.cartographer is not None
            # A snapshot from before the creature memory loads with an empty one.
            parts = {
                f"atlas.{k}": v for k, v in self.cartographer.no_creatures(self.device).items()
            } | tensors
            missing = [f.name for f in fields(Atlas) if f"atlas.{f.name}" not in parts]
            if missing:
                raise ValueError(f"plug-in state: atlas fields {missing} are missing")
            atlas = Atlas(**{f.name: parts[f"atlas.{f.name}"].to(self.device) for f in fields(Atlas)})
            if atlas.creature_at.shape != (self.cartographer.memory,) * 2:
                got = tuple(atlas.creature_at.shape)
                raise ValueError(f"plug-in state: creature memory {got} does not fit this world's atlas")
        trail = tensors.get("trail")
        if trail is not None:
            if self.creatures is None:
                raise ValueError("plug-in state has a creature trail; this world has no creature head")
            want = (3, self.creatures.cfg.lags - 1, h, w)
            if tuple(trail.shape) != want:
                raise ValueError(f"plug-in state: creature trail {tuple(trail.shape)} is not {want}")
            trail = trail.to(self.device, self.dtype)
        return TinyState(last.to(self.device, self.dtype), atlas, trail)

    def save(self, root: Path) -> dict[str, Any]:
        """Write the motion head and prior weights under `root`; returns the "plugin" block."""
        block: dict[str, Any] = {"name": NAME, **self.settings.to_dict()}
        if self.motion is not None:
            block["motion"] = self.motion.cfg.to_dict()
            _save_weights(self.motion, root / MOTION_WEIGHTS)
        if self.terrain is not None:
            block["terrain"] = self.terrain.cfg.to_dict()
            _save_weights(self.terrain, root / TERRAIN_WEIGHTS)
        if self.creatures is not None:
            block["creatures"] = self.creatures.cfg.to_dict()
            _save_weights(self.creatures, root / CREATURE_WEIGHTS)
        return block


def _save_weights(module: torch.nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in module.state_dict().items()}, str(path))


def _load_weights(module: torch.nn.Module, path: Path) -> None:
    """Strict: every key on both sides with the same shape (a wrong file fails at load)."""
    state = load_file(str(path))
    own = module.state_dict()
    bad = sorted(set(own) ^ set(state)) + [k for k in own if k in state and own[k].shape != state[k].shape]
    if bad:
        raise ValueError(f"{path}: keys missing, unexpected or mismatched: {bad[:8]}")
    module.load_state_dict(state, strict=True)


def load_plugin(root: str | Path, block: dict[str, Any]) -> TinyWorldPlugin:
    """The plug-in of a model directory `root` from its worldserve.json "plugin" block (on the
    CPU; `World` moves it to its device)."""
    root = Path(root)
    if block.get("name") != NAME:
        raise ValueError(f"{root}: plugin {block.get('name')!r} is not {NAME!r}")
    try:
        settings = TinyWorldSettings.from_dict(block)
    except ValueError as e:
        raise ValueError(f"{root}: {e}") from None
    if "gate" in block:
        raise ValueError(
            f"{root}: its key gate planned motion by the game's hand-written rule, which worldserve no "
            "longer serves; train a learned motion head in its place: "
            f"python -m models.tiny_world.motion --model {root}"
        )
    motion = terrain = creatures = None
    if "motion" in block:
        motion = MotionHead(MotionHeadConfig.from_dict(block["motion"]))
        _load_weights(motion, root / MOTION_WEIGHTS)
    if "terrain" in block:
        terrain = TerrainPrior(TerrainPriorConfig.from_dict(block["terrain"]))
        _load_weights(terrain, root / TERRAIN_WEIGHTS)
    if "creatures" in block:
        creatures = CreatureHead(CreatureHeadConfig.from_dict(block["creatures"]))
        _load_weights(creatures, root / CREATURE_WEIGHTS)
    if settings.atlas_tiles and motion is None:
        raise ValueError(f"{root}: atlas_tiles needs a motion head (its predicted pose files the tiles)")
    return TinyWorldPlugin(settings, motion, terrain, creatures)


def served_plugin(
    carry_channels: Sequence[int] = (),
    motion: MotionHead | None = None,
    terrain: TerrainPrior | None = None,
    creatures: CreatureHead | None = None,
) -> TinyWorldPlugin:
    """The plug-in a tiny world is served with (as the trainer exports it): `carry_channels`, the
    motion head, and with it an atlas with the terrain prior and the creature head."""
    atlas = atlas_tiles(motion)
    settings = TinyWorldSettings(carry_channels=tuple(carry_channels), atlas_tiles=atlas)
    return TinyWorldPlugin(settings, motion, terrain if atlas else None, creatures if atlas else None)


def _update_block(root: Path, part: str, module: torch.nn.Module, config: dict, weights: str) -> None:
    meta_path = root / "worldserve.json"
    meta = json.loads(meta_path.read_text())
    block = meta.setdefault("plugin", {"name": NAME})
    block[part] = config
    _save_weights(module, root / weights)
    meta_path.write_text(json.dumps(meta, indent=2))


def save_motion(head: MotionHead, path: str | Path) -> None:
    """Write a motion head into a model directory: its weights, and its config as the "plugin"
    block's "motion" (the rest of the directory is left as it is)."""
    _update_block(Path(path), "motion", head, head.cfg.to_dict(), MOTION_WEIGHTS)


def save_terrain(prior: TerrainPrior, path: str | Path) -> None:
    """Write a terrain prior into a model directory, as `save_motion` a motion head ("terrain")."""
    _update_block(Path(path), "terrain", prior, prior.cfg.to_dict(), TERRAIN_WEIGHTS)


def save_creatures(head: CreatureHead, path: str | Path) -> None:
    """Write a creature head into a model directory, as `save_motion` a motion head ("creatures")."""
    _update_block(Path(path), "creatures", head, head.cfg.to_dict(), CREATURE_WEIGHTS)
