"""The DiT stage: teacher-forced flow matching on clips (CausVid), with the DiT surgery the later
stages use (`regrid`, `deepen`, `with_marker`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from models.causal_wan import CausalWan, frame_attention_mask
from models.sampler import add_noise
from models.tiny_world import TRAIN_SCHEDULE
from models.tiny_world.marker import MarkerConfig, SpriteMarker, dit_marker, marker_spec, sprite_marker
from models.tiny_world.sampling import carry
from models.tiny_world.training.config import SF_STAGES, lr_at
from models.tiny_world.training.targets import frames_of


def teacher_forcing_layout(n_chunks: int, chunk: int, window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mask and RoPE positions of a teacher-forced clip of 1 + n_chunks * chunk frames.

    Sequence order: the clean copies of all F frames (the start frame, then the chunks), then
    noisy copies of frames 1..F-1::

        index:    0 .. F-1            F .. 2F-2
                [ clean 0 .. F-1   | noisy 1 .. F-1 ]
        position: 0 .. F-1            1 .. F-1

    Clean copies see each other block-causally (the serving mask, chunk sizes [1, chunk, ...]);
    a noisy chunk sees the clean frames its serving twin would find in the KV cache, plus itself.
    Returns (mask (2F-1, 2F-1) bool, positions (2F-1,) int64, F).
    """
    sizes = [1] + [chunk] * n_chunks
    f = sum(sizes)
    base = frame_attention_mask(sizes, window)  # (F, F)
    total = 2 * f - 1
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:f, :f] = base
    s = 1
    for _ in range(n_chunks):
        rows = slice(f + s - 1, f + s - 1 + chunk)
        mask[rows, :f] = base[s : s + chunk]
        mask[rows, s : s + chunk] = False  # not its own clean copy ...
        mask[rows, rows] = True  # ... but itself
        s += chunk
    positions = torch.cat([torch.arange(f), torch.arange(1, f)])
    return mask, positions, f


def sample_sigmas(
    gen: torch.Generator,
    shape: tuple[int, ...],
    schedule_sigmas: Sequence[float],
    shift: float,
    p_schedule: float,
) -> torch.Tensor:
    """Per-chunk noise levels: the unrolled schedule's sigmas with probability `p_schedule`, else
    shifted uniform (`shift * u / (1 + (shift - 1) u)`, as the sampler warps its steps)."""
    u = torch.rand(shape, generator=gen)
    cont = shift * u / (1 + (shift - 1) * u)
    table = torch.tensor(list(schedule_sigmas), dtype=torch.float32)
    pick = table[torch.randint(len(table), shape, generator=gen)]
    use = torch.rand(shape, generator=gen) < p_schedule
    return torch.where(use, pick, cont)


def regrid(dit: CausalWan, patch: int, window: int) -> CausalWan:
    """A copy of `dit` on a `patch` x `patch` token grid with a `window`-frame attention window.

    Every block carries over unchanged; the patch embedding of a finer token is the coarse one's
    response to a flat patch (its kernel summed over the coarse patch), and the head's output of
    a finer token is the mean of the coarse head's outputs over its patch, so a flat region is
    embedded and read out as before. Refining by an integer factor only."""
    old = dit.cfg.patch_size[1]
    if old % patch or dit.cfg.patch_size[1] != dit.cfg.patch_size[2]:
        raise ValueError(f"cannot regrid a {dit.cfg.patch_size} patch to {patch}")
    cfg = replace(dit.cfg, patch_size=(1, patch, patch), window_frames=window)
    out = CausalWan(cfg, dit.input_features)
    state = dict(dit.state_dict())
    f = old // patch  # fine tokens per coarse token along each side; coarse row = i * patch + fine row
    w = state["patch_embedding.weight"]  # (D, C, 1, old, old)
    state["patch_embedding.weight"] = w.unflatten(3, (f, patch)).unflatten(5, (f, patch)).sum((3, 5))
    c = cfg.out_channels
    head_w = state["proj_out.weight"].view(f, patch, f, patch, c, -1)  # rows ordered (ph, pw, C)
    head_b = state["proj_out.bias"].view(f, patch, f, patch, c)
    state["proj_out.weight"] = head_w.mean((0, 2)).flatten(0, 2)
    state["proj_out.bias"] = head_b.mean((0, 2)).flatten()
    out.load_state_dict(state)
    return out


def deepen(dit: CausalWan, layers: int, seed: int) -> CausalWan:
    """A copy of `dit` with `layers` blocks: block i of `dit` becomes block i * layers // n
    (spread evenly) and the blocks between are new, with every projection onto the residual
    stream (self- and cross-attention outputs, the action module's output, the feed-forward's
    last layer) zero. A zero projection makes a block the identity, so the deeper model computes
    exactly what `dit` does and training grows into the new capacity. The new blocks' other
    weights are drawn from `seed`. Every block keeps an action module, so `dit` must have one in all."""
    n, cfg = dit.cfg.num_layers, dit.cfg
    if layers <= n:
        raise ValueError(f"deepen: {layers} layers is not more than the model's {n}")
    if cfg.action is None or cfg.action.kind != "worldserve" or cfg.action.blocks < n:
        raise ValueError("deepen needs the worldserve action module in every block")
    new_cfg = replace(cfg, num_layers=layers, action=replace(cfg.action, blocks=layers))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = CausalWan(new_cfg, dit.input_features)
    place = {i * layers // n: i for i in range(n)}
    state = out.state_dict()
    for key, value in dit.state_dict().items():
        if not key.startswith("blocks."):
            state[key] = value
    residual = ("attn1.to_out.0.", "attn2.to_out.0.", "action.key_out.", "action.motion_out.", "ffn.net.2.")
    for j in range(layers):
        if j in place:
            old = dit.blocks[place[j]].state_dict()
            state.update({f"blocks.{j}.{k}": v for k, v in old.items()})
        else:
            for key in [k for k in state if k.startswith(tuple(f"blocks.{j}.{r}" for r in residual))]:
                state[key] = torch.zeros_like(state[key])
    out.load_state_dict(state)
    return out


def with_marker(dit: CausalWan, marker: MarkerConfig) -> CausalWan:
    """A copy of `dit` that also reads the per-cell sprite marker (`sprite_marker`): the patch
    embedding grows the marker's input channels with zero weights, so the copy computes exactly
    what `dit` does until training gives them weight."""
    if dit.cfg.input_features is not None:
        raise ValueError("the DiT already reads input features")
    out = CausalWan(replace(dit.cfg, input_features=marker_spec(marker)), SpriteMarker(marker))
    state = dict(dit.state_dict())
    w = state["patch_embedding.weight"]  # (D, C, 1, ph, pw)
    state["patch_embedding.weight"] = zero_inputs(w, w.shape[1], MarkerConfig.channels)
    out.load_state_dict(state)
    return out


def zero_inputs(weight: torch.Tensor, at: int, n: int) -> torch.Tensor:
    """A layer's weight (out, in, ...) with `n` zero input columns inserted before column `at`:
    the layer computes what it did for any values of the new inputs."""
    pad = weight.new_zeros(weight.shape[0], n, *weight.shape[2:])
    return torch.cat([weight[:, :at], pad, weight[:, at:]], dim=1)


def widen(dit: CausalWan, channels: int) -> CausalWan:
    """A copy of `dit` over latents with `channels` (more than its own): the new channels come
    last, read with zero weights and written as zero flow, so with them carried from the latest
    frame (`carry`) the copy leaves them as they were and computes what `dit` does elsewhere."""
    old = dit.cfg.in_channels
    if channels <= old or dit.cfg.out_channels != old:
        raise ValueError(f"cannot widen a DiT of {old} latent channels to {channels}")
    out = CausalWan(replace(dit.cfg, in_channels=channels, out_channels=channels), dit.input_features)
    state = dict(dit.state_dict())
    # (D, C [+ input features], pt, ph, pw): the new channels before any input features
    state["patch_embedding.weight"] = zero_inputs(state["patch_embedding.weight"], old, channels - old)
    patch = math.prod(dit.cfg.patch_size)
    for name in ("proj_out.weight", "proj_out.bias"):  # rows: (patch position, channel)
        p = state[name].view(patch, old, *state[name].shape[1:])
        zeros = p.new_zeros(patch, channels - old, *p.shape[2:])
        state[name] = torch.cat([p, zeros], dim=1).flatten(0, 1)
    out.load_state_dict(state)
    return out


class DiTStage:
    """The trainer's `dit` stage and the flow-matching step every DiT stage takes (a part of `Trainer`)."""

    def train_dit(self) -> bool:
        """Returns False when the time limit stopped it."""
        lat, acts, cams, _ = self.latents()
        self.mark()
        c, dit = self.cfg, self.dit
        self.episodes = None  # the frames are no longer needed
        dcfg = dit.cfg
        mask, positions, f = teacher_forcing_layout(c.clip_chunks, dcfg.chunk_frames, dcfg.window_frames)
        n_eps, n_frames = lat.shape[:2]
        dit.train()
        bar = tqdm(total=c.dit_steps, initial=self.step, desc="dit", disable=not self.progress)
        while self.step < c.dit_steps:
            e = self.rng.integers(0, n_eps, size=c.dit_batch)
            s = self.rng.integers(0, n_frames - f + 1, size=c.dit_batch)
            idx = s[:, None] + np.arange(f)[None, :]  # (B, F)
            x0, hist = self.clip_latents(lat, cams, e, idx)  # (B, C, F, h, w) each
            a = acts[e[:, None], idx].clone()  # (B, F, width)
            a[:, 0] = 0.0  # the start frame is prefilled with an idle action when served
            a = a[:, :, None]  # (B, F, 1, width): one video frame per latent frame
            loss, gnorm = self.flow_step(x0, hist, a, mask, positions, f, c.dit_lr, c.dit_steps, c.warmup)
            self.step += 1
            bar.update(1)
            if self.step % c.log_every == 0 or self.step == c.dit_steps:
                bar.set_postfix(loss=f"{loss:.4f}")
                self.log({"loss": loss, "grad_norm": gnorm, "t": self.total_elapsed(), **self.phase_log})
            if not self.step_done(bar):
                return False
        bar.close()
        if self.cfg.sf_steps > 0:
            self.stage = "sf"
            self.begin_sf()
        else:
            self.end_dit()
        self.checkpoint()
        return True

    def end_dit(self) -> None:
        """After the last DiT stage: the motion head's stage, or done."""
        self.stage, self.step = ("motion" if self.cfg.motion_steps > 0 else "done"), 0

    def flow_step(
        self,
        x0: torch.Tensor,
        hist: torch.Tensor,
        a: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        f: int,
        peak_lr: float,
        total: int,
        warmup: int,
        weight: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
        motions: torch.Tensor | None = None,
    ) -> tuple[float, float]:
        """One optimiser step of the teacher-forced flow loss: the noisy chunks are the
        ground truth `x0` (B, C, F, h, w), the clean copies they attend to are `hist` (the
        ground truth itself, or the model's rollout). `weight` (B, 1, F-1, h, w) weights the
        noisy frames' squared errors (normalised by its sum; None: the plain mean). `extra`, a
        loss with its graph (the chain loss), joins the step; `motions` (B, F, 8) are the clip
        frames' `key_motions`, for the motion head. Updates the EMA; returns (flow
        loss, grad norm)."""
        c, dit = self.cfg, self.dit
        sched = TRAIN_SCHEDULE
        chunk = dit.cfg.chunk_frames
        n_chunks = (f - 1) // chunk
        b = x0.shape[0]
        sig_c = torch.rand(b, 1 + n_chunks, generator=self.gen) * c.context_sigma
        sig_n = sample_sigmas(self.gen, (b, n_chunks), sched.sigmas, sched.shift, c.p_schedule_sigma)
        sig_c_f = torch.cat([sig_c[:, :1], sig_c[:, 1:].repeat_interleave(chunk, dim=1)], dim=1)
        sig_n_f = sig_n.repeat_interleave(chunk, dim=1)
        eps_c = torch.randn(x0.shape, generator=self.gen)
        eps_n = torch.randn(x0[:, :, 1:].shape, generator=self.gen)
        carried = self.carried()
        if carried:
            # As served (`World.carry`): each chunk's carried channels start from the latest
            # history frame before it, so the model learns to move the player / the view from there.
            for j in range(n_chunks):
                a0 = j * chunk
                carry(eps_n[:, :, a0 : a0 + chunk], hist[:, :, a0 : a0 + 1], carried)
        xc = add_noise(hist, eps_c, sig_c_f[:, None, :, None, None])
        xn = add_noise(x0[:, :, 1:], eps_n, sig_n_f[:, None, :, None, None])
        seq = torch.cat([xc, xn], dim=2)
        t = torch.cat([sig_c_f, sig_n_f], dim=1) * sched.num_train
        seq_a = torch.cat([a, a[:, 1:]], dim=1)
        text = [dit.text_kv(dit.null_text("cpu", torch.float32))] * b
        heads = self.aux_heads if self.stage in SF_STAGES else None
        last: list[torch.Tensor] = []
        hook = dit.blocks[-1].register_forward_hook(lambda _m, _i, out: last.append(out)) if heads else None
        pred = dit.forward_dense(seq, t, text, mask, seq_a, positions)[:, :, f:]
        if hook is not None:
            hook.remove()
        err = (pred - (eps_n - x0[:, :, 1:])).pow(2)
        phase = self.ae.cfg.phase_slice if self.ae.cfg.frame_size else None
        if phase is not None:
            self.phase_log = {"phase_loss": err[:, phase].mean().item()}
        if self.ae.cfg.creatures:
            # Over the cells that hold a creature only: the others are nearly all of them, and easy.
            cs = self.ae.cfg.creature_slice
            held = (x0[:, cs.start : cs.start + 1, 1:] > 0).expand_as(err[:, cs])
            self.phase_log["creature_loss"] = err[:, cs][held].mean().item() if held.any() else 0.0
        phase_weight = self.sf_config().sf_phase_weight if self.stage in SF_STAGES else 1.0
        creature_weight = c.creature_weight if self.ae.cfg.creatures else 1.0
        if phase_weight != 1.0 or creature_weight != 1.0:
            scale = torch.ones(err.shape[1])
            scale[phase] = phase_weight
            scale[self.ae.cfg.creature_slice] = creature_weight
            err = err * scale[:, None, None, None]
        if c.loss_weight == "x0":
            err = err * sig_n_f[:, None, :, None, None].pow(2)
        if weight is None:
            loss = err.mean()
        else:
            weight = weight.expand_as(err)
            loss = (err * weight).sum() / weight.sum().clamp_min(1.0)
        total_loss, fake = (loss if extra is None else loss + extra), None
        if heads is not None and heads.marker is not None:
            # Every token of both copies predicts the marker of its cells in the clean frames.
            clean = torch.cat([hist, x0[:, :, 1:]], dim=2)
            want = heads.marker_targets(sprite_marker(clean, dit_marker(dit.cfg)))
            aux = (heads.marker(last[0]) - want).pow(2).mean()
            total_loss = total_loss + c.sf_marker_aux * aux
            self.phase_log["marker_aux"] = aux.item()
        if heads is not None and heads.motion is not None and motions is not None:
            # Every token of the clean copy predicts its frame's motions under each key.
            tokens = last[0][:, : last[0].shape[1] * f // (2 * f - 1)]
            got = heads.motion(tokens).view(b, f, -1, motions.shape[-1])
            aux = (got - motions[:, :, None]).pow(2).mean()
            total_loss = total_loss + c.sf_motion_aux * aux
            self.phase_log["motion_aux"] = aux.item()
        if self.critic is not None and self.stage in SF_STAGES:
            # One frame per noisy chunk: its x0 prediction decoded (through the frozen decoder)
            # and scored by the critic; the hinge generator loss joins the flow loss.
            pick = torch.randint(0, chunk, (b, n_chunks), generator=self.gen) + torch.arange(n_chunks) * chunk
            rows = torch.arange(b)[:, None]
            sig = sig_n_f[rows, pick][:, :, None, None, None]  # (B, chunks, 1, 1, 1)
            x0_hat = (xn[rows, :, pick] - sig * pred[rows, :, pick]).permute(0, 2, 1, 3, 4)
            fake = frames_of(self.ae.decode_float(x0_hat))
            self.critic.requires_grad_(False)
            adv_g = -self.critic(fake).mean()
            self.critic.requires_grad_(True)
            total_loss = total_loss + c.sf_adv * adv_g
        for group in self.dit_opt.param_groups:
            group["lr"] = lr_at(self.step, total, peak_lr, warmup)
        self.dit_opt.zero_grad(set_to_none=True)
        if heads is not None:
            self.aux_opt.zero_grad(set_to_none=True)
        total_loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        self.dit_opt.step()
        if heads is not None:
            self.aux_opt.step()
        if fake is not None:
            with torch.no_grad():
                real = frames_of(self.ae.decode_float(x0[:, :, 1:][rows, :, pick].permute(0, 2, 1, 3, 4)))
            d_real, d_fake = self.critic(real), self.critic(fake.detach())
            adv_d = torch.relu(1.0 - d_real).mean() + torch.relu(1.0 + d_fake).mean()
            self.critic_opt.zero_grad(set_to_none=True)
            adv_d.backward()
            self.critic_opt.step()
            self.adv_log = {"adv_g": adv_g.item(), "adv_d": adv_d.item()}
        with torch.no_grad():
            decay = min(c.ema, (1 + self.step) / (10 + self.step))
            for pe, p in zip(self.ema.parameters(), dit.parameters(), strict=True):
                pe.lerp_(p, 1 - decay)
        return loss.item(), gnorm.item()
