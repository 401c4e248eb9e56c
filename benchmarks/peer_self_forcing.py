"""Peer benchmark: an original Self-Forcing checkout and our engine, same seeded weights, one process.

    python benchmarks/peer_self_forcing.py --upstream DIR [--chunks 10] [--sessions 4] [--threads 2]

DIR is a checkout of the original Self-Forcing repository (never vendored: it is imported from DIR
at run time). Both sides get the same causal Wan at a small shape (dim 512, 8 heads, 8 layers,
64 tokens a frame, 3 frames a chunk, a 21-frame window, 4 denoising steps + the clean context
pass, fp32) with seeded random weights, loaded into ours through our converter's key map
(`models/convert/self_forcing.py`), the same 512-token text embedding and the same noise. They
run turn by turn, chunk by chunk:

(a) one session: the time of chunk k on each side, and the ratio ours / original per chunk index;
(b) `--sessions` sessions: one batched step of our engine vs as many original rollouts run one
    after the other (each its own pipeline and cache, as the original serves one prompt at a time);
(c) the max abs difference of the chunks' clean latents between the two sides.

The original side is its own `CausalInferencePipeline.inference` loop, unmodified, on a thread
of its own that is paused after each chunk's context pass (a wrapper around its generator's
forward) and resumed for the next turn, so the two sides never run at once. Our side is the
engine's chunk forwards as `runtime/batch.py` runs them (`World.denoise` x4, `World.context`, the
index and noise of a step); no decode on either side (`benchmarks/engine_overhead.py` measures
the engine's own bookkeeping).

Shims, applied in this process at import time only (what the original needs that a CPU machine
without its extra packages lacks; none changes its arithmetic):

* `wan` and `wan.modules` are registered as bare packages, so their `__init__` files (the T5
  text encoder, the VAE, configs) are not imported; packages the pipeline imports but this run
  never calls (einops, ftfy, easydict, transformers, when absent) are stand-ins that raise if
  used; `torch.cuda.current_device` answers 0 while the modules load (a default argument of the
  T5 encoder calls it).
* `flash_attn` is absent, and the original's fallback casts q, k, v to bfloat16: its two
  attention entry points (`attention`, `flash_attention`) are replaced by the same
  `scaled_dot_product_attention` in the inputs' dtype ([B, L, heads, head_dim] in and out), so
  both sides compute in fp32.
* the pipeline's KV-cache constructors hard-code Wan-1.3B's 30 blocks, 12 heads x 128 and 1560
  tokens a frame: its `num_transformer_blocks`, `frame_seq_length` and the two cache
  constructors are set for this shape (the same dicts, sized from the model).
* `WanDiffusionWrapper` loads its weights from disk: `CausalWanModel.from_pretrained` returns
  the seeded model; the text encoder and the VAE are stand-ins (fixed embeddings; no decode).
* the re-noising between steps draws `torch.randn_like` from the global generator: the
  scheduler's `add_noise` is given our engine's noise for that (session, chunk, step) instead.

Prints a table and writes benchmarks/results/peer_self_forcing.json (or --out). Each turn is
timed in wall clock and in the process's CPU time (which a busy machine inflates less: time the
core spends on another process is not counted), `--repeats` fresh rollouts, the best of each
turn kept; `--threads` intra-op threads; the load average is recorded. OpenMP's idle workers
wait passively (`OMP_WAIT_POLICY=PASSIVE` unless set): two teams share the process, and spinning
workers of the side that just ran slowed the other side's next turn.
"""

from __future__ import annotations

import os

# Two OpenMP teams live in this process (ours on the main thread, the original's on its own):
# with the default active wait, the idle team's workers spin through the other side's turn and
# slow it (measured: our first chunk after an original turn took 2-3x its time). Set before
# torch loads OpenMP; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import importlib.machinery
import json
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.convert import self_forcing
from models.convert.keymap import apply
from models.registry import build_world
from models.sampler import FlowSchedule
from models.world import Conditioning, World, WorldConfig
from runtime.kv_cache import KVLayout

RESULTS = Path(__file__).parent / "results"
SHAPE = {  # the original's CausalWanModel kwargs at the benchmark shape
    "model_type": "t2v",
    "patch_size": (1, 2, 2),
    "text_len": 512,
    "in_dim": 16,
    "dim": 512,
    "ffn_dim": 2048,
    "freq_dim": 256,
    "text_dim": 4096,
    "out_dim": 16,
    "num_heads": 8,
    "num_layers": 8,
    "local_attn_size": 21,
    "sink_size": 0,
    "qk_norm": True,
    "cross_attn_norm": True,
    "eps": 1e-6,
}
LATENT = (16, 16, 16)  # channels, h, w: 8 x 8 = 64 tokens a frame after 1x2x2 patching
STEPS = (1000, 750, 500, 250)
SHIFT = 5.0


# --- the original, imported from its checkout --------------------------------------------------


class _Absent(types.ModuleType):
    """A stand-in for a package the original imports but this run never calls."""

    def __getattr__(self, name: str) -> Callable:
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a stand-in of peer_self_forcing.py")

        return absent


def _sdpa_blhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The original's attention signature ([B, L, heads, head_dim]), in the inputs' dtype."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    )
    return out.transpose(1, 2).contiguous()


def import_upstream(root: Path) -> types.SimpleNamespace:
    """The original's causal model, wrapper and pipeline modules, shimmed (module docstring)."""
    root = root.resolve()
    if not (root / "wan" / "modules" / "causal_model.py").is_file():
        raise SystemExit(f"{root} is not a Self-Forcing checkout (no wan/modules/causal_model.py)")
    sys.path.insert(0, str(root))
    for name in ("wan", "wan.modules"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = pkg
    stubs = []
    for name in ("einops", "ftfy", "easydict", "transformers"):
        with contextlib.suppress(ImportError):
            __import__(name)
            continue
        mod = _Absent(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__path__ = []
        sys.modules[name] = mod
        stubs.append(name)
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        import pipeline.causal_inference as inference
        import utils.wan_wrapper as wrapper
        import wan.modules.causal_model as causal
        import wan.modules.model as base
    finally:
        torch.cuda.current_device = current
        for name in stubs:  # the original's modules keep their references; nothing else sees them
            del sys.modules[name]
    causal.attention = _sdpa_blhd
    base.flash_attention = _sdpa_blhd
    inference.print = lambda *args, **kwargs: None  # the loop prints every timestep
    return types.SimpleNamespace(causal=causal, wrapper=wrapper, inference=inference, stubs=stubs)


def seeded_original(up: types.SimpleNamespace, seed: int) -> torch.nn.Module:
    """The original's CausalWanModel at SHAPE, every parameter drawn from `seed` (its own init
    zeroes the output head, which would make any two models agree)."""
    model = up.causal.CausalWanModel(**SHAPE).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel() if "modulation" not in name else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    return model


class _Text:
    """The pipeline's text encoder: a fixed embedding."""

    def __init__(self, embeds: torch.Tensor) -> None:
        self.embeds = embeds

    def __call__(self, text_prompts: list[str]) -> dict:
        return {"prompt_embeds": self.embeds}


class _NoDecode:
    """The pipeline's VAE: decoding is not measured."""

    def decode_to_pixel(self, latents: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        return latents


class OriginalSession:
    """One original rollout (`CausalInferencePipeline.inference`) on a thread of its own, run one
    chunk a turn: `chunk()` resumes it and returns when its context pass is done."""

    def __init__(
        self,
        up: types.SimpleNamespace,
        model: torch.nn.Module,
        text: torch.Tensor,
        noise: NoiseFn,
        chunks: int,
    ) -> None:
        model_cls = up.causal.CausalWanModel
        saved = model_cls.from_pretrained
        model_cls.from_pretrained = classmethod(lambda cls, *a, **k: model)
        try:
            gen = up.wrapper.WanDiffusionWrapper(
                timestep_shift=SHIFT, is_causal=True, local_attn_size=SHAPE["local_attn_size"]
            )
        finally:
            model_cls.from_pretrained = saved
        args = types.SimpleNamespace(
            denoising_step_list=list(STEPS),
            warp_denoising_step=True,
            num_frame_per_block=3,
            independent_first_frame=False,
            context_noise=0,
        )
        pipe = up.inference.CausalInferencePipeline(
            args, "cpu", generator=gen, text_encoder=_Text(text), vae=_NoDecode()
        )
        pipe.num_transformer_blocks = SHAPE["num_layers"]
        pipe.frame_seq_length = LATENT[1] * LATENT[2] // 4
        pipe._initialize_kv_cache = self._kv_cache
        pipe._initialize_crossattn_cache = self._cross_cache
        self.pipe = pipe
        self.chunks = chunks
        self.noise = noise
        self.outputs: list[torch.Tensor] = []  # each chunk's clean latents (C, n, h, w)
        self._chunk = 0
        self._renoised = 0
        add_noise = pipe.scheduler.add_noise

        def our_noise(x0: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
            self._renoised += 1
            ours = self.noise(self._chunk, self._renoised)  # (C, n, h, w)
            return add_noise(x0, ours.permute(1, 0, 2, 3).to(noise), timestep)

        pipe.scheduler.add_noise = our_noise
        forward = gen.forward

        def paused(*args, **kwargs):
            out = forward(*args, **kwargs)
            if bool((kwargs["timestep"] == args_ctx).all()):  # the context pass: the chunk is done
                self.outputs.append(kwargs["noisy_image_or_video"][0].permute(1, 0, 2, 3).clone())
                self._chunk += 1
                self._renoised = 0
                self._done.set()
                self._go.wait()
                self._go.clear()
            return out

        args_ctx = args.context_noise
        gen.forward = paused
        self._go, self._done = threading.Event(), threading.Event()
        first = torch.cat([self.noise(c, 0) for c in range(chunks)], dim=1)  # (C, chunks * n, h, w)
        self._thread = threading.Thread(
            target=self._run, args=(first.permute(1, 0, 2, 3)[None],), daemon=True, name="original"
        )
        self._started = False

    def _kv_cache(self, batch_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        size = SHAPE["local_attn_size"] * self.pipe.frame_seq_length
        heads, hd = SHAPE["num_heads"], SHAPE["dim"] // SHAPE["num_heads"]
        self.pipe.kv_cache1 = [
            {
                "k": torch.zeros([batch_size, size, heads, hd], dtype=dtype, device=device),
                "v": torch.zeros([batch_size, size, heads, hd], dtype=dtype, device=device),
                "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
                "local_end_index": torch.tensor([0], dtype=torch.long, device=device),
            }
            for _ in range(SHAPE["num_layers"])
        ]

    def _cross_cache(self, batch_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        heads, hd = SHAPE["num_heads"], SHAPE["dim"] // SHAPE["num_heads"]
        shape = [batch_size, SHAPE["text_len"], heads, hd]
        self.pipe.crossattn_cache = [
            {"k": torch.zeros(shape, dtype=dtype), "v": torch.zeros(shape, dtype=dtype), "is_init": False}
            for _ in range(SHAPE["num_layers"])
        ]

    def _run(self, noise: torch.Tensor) -> None:
        with torch.no_grad():
            self.pipe.inference(noise, ["peer"])
        self._done.set()

    def chunk(self) -> None:
        """Run the next chunk (its 4 denoising forwards and its context pass)."""
        self._done.clear()
        if not self._started:
            self._started = True
            self._thread.start()
        else:
            self._go.set()
        self._done.wait()

    def close(self) -> None:
        """Let the rollout finish (its last chunk is already done)."""
        self._go.set()
        self._thread.join(timeout=60)


NoiseFn = Callable[[int, int], torch.Tensor]  # (chunk, step) -> (C, n, h, w)


# --- ours ----------------------------------------------------------------------------------------


def our_world(original: torch.nn.Module) -> World:
    """Our world at the same shape, the original's weights through our converter's key map."""
    cfg = self_forcing.model_config(
        {k: v for k, v in SHAPE.items() if k != "patch_size"} | {"patch_size": [1, 2, 2]}
    )
    c, h, w = LATENT
    world_cfg = WorldConfig(
        id="peer-self-forcing", fps=16.0, width=8 * w, height=8 * h, schedule=FlowSchedule(STEPS, SHIFT)
    )
    vae = {  # a small Wan VAE with the real factors (8x spatial, 4x temporal); it never runs here
        "base_dim": 8,
        "z_dim": c,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True, True],
        "latents_mean": [0.0] * c,
        "latents_std": [1.0] * c,
    }
    world = build_world(world_cfg, cfg, vae, seed=None)
    state = {self_forcing.PREFIX + k: v for k, v in original.state_dict().items()}
    mapped = apply(state, self_forcing.key_map(SHAPE), self_forcing.target_shapes(cfg), "peer")
    world.transformer.load_state_dict(mapped)
    return world


@dataclass
class OurSession:
    """A session of ours: its world state and committed frames."""

    state: object
    frames: int = 0


def our_chunk(world: World, layout: KVLayout, sessions: list[OurSession], chunk: int) -> torch.Tensor:
    """One engine step for `sessions` (runtime/batch.py's denoise + context): their clean latents."""
    n = world.chunk_frames
    index = layout.index([s.state.row for s in sessions], [s.frames for s in sessions], n, world.pad_row)
    sched = world.config.schedule
    keys = [(s.state.seed, chunk, 0) for s in sessions]
    x = world.noise_batch(keys, n)
    for k, (tk, sg) in enumerate(zip(sched.timesteps, sched.sigmas, strict=True)):
        x0 = sched.to_x0(world.denoise(x, tk, index, None), x, sg)
        if k + 1 < len(sched.steps):
            nxt = world.noise_batch([(s.state.seed, chunk, k + 1) for s in sessions], n)
            x = sched.next_x(x0, x, sg, sched.sigmas[k + 1], lambda nxt=nxt: nxt)
    world.context(x0, index, None)
    for s in sessions:
        s.frames += n
    return x0


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Turns:
    """Per chunk index, the best wall and CPU time (ms) over the repeats of one side's turns."""

    wall: list[float]
    cpu: list[float]

    @classmethod
    def empty(cls, chunks: int) -> Turns:
        return cls([float("inf")] * chunks, [float("inf")] * chunks)

    @contextlib.contextmanager
    def turn(self, chunk: int) -> Iterator[None]:
        """Time one turn: wall clock, and the process's CPU time (all its threads; only one side
        runs at a time, and CPU time does not count the time another process holds the core)."""
        w0, c0 = time.perf_counter(), time.process_time()
        yield
        self.wall[chunk] = min(self.wall[chunk], (time.perf_counter() - w0) * 1000)
        self.cpu[chunk] = min(self.cpu[chunk], (time.process_time() - c0) * 1000)


def ratios(ours: Turns, original: Turns) -> dict:
    """Both sides' times and ours / original per chunk index, wall and CPU."""
    return {
        "ours_ms": ours.wall,
        "original_ms": original.wall,
        "ratio": [a / b for a, b in zip(ours.wall, original.wall, strict=True)],
        "ours_cpu_ms": ours.cpu,
        "original_cpu_ms": original.cpu,
        "cpu_ratio": [a / b for a, b in zip(ours.cpu, original.cpu, strict=True)],
    }


def run(root: Path, chunks: int, sessions: int, seed: int, repeats: int) -> dict:
    """Both sides, turn by turn, `repeats` fresh rollouts; the figures of (a), (b) and (c)."""
    up = import_upstream(root)
    original = seeded_original(up, seed)
    world, solo_world = our_world(original), our_world(original)
    world.setup(sessions)
    solo_world.setup(1)
    cfg = world.transformer.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, world.tokens_per_frame)
    gen = torch.Generator().manual_seed(seed + 1)
    texts = [torch.randn(SHAPE["text_len"], SHAPE["text_dim"], generator=gen) for _ in range(sessions)]
    seeds = [100 + i for i in range(sessions)]

    def noise_of(i: int) -> NoiseFn:
        return lambda chunk, step: world.noise(seeds[i], chunk, step, world.chunk_frames)

    # (a): session 0 alone on both sides; (b): every session, ours batched, the originals in turn
    solo_ours, solo_orig = Turns.empty(chunks), Turns.empty(chunks)
    batch_ours, batch_orig = Turns.empty(chunks), Turns.empty(chunks)
    worst, worst_solo = 0.0, 0.0
    load = os.getloadavg()
    for _ in range(repeats):
        ours = [
            OurSession(world.init_state(Conditioning(seed=s, text=t)))
            for s, t in zip(seeds, texts, strict=True)
        ]
        solo = OurSession(solo_world.init_state(Conditioning(seed=seeds[0], text=texts[0])))
        originals = [
            OriginalSession(up, original, texts[i][None], noise_of(i), chunks) for i in range(sessions)
        ]
        alone = OriginalSession(up, original, texts[0][None], noise_of(0), chunks)
        with torch.no_grad():
            for c in range(chunks):
                with solo_ours.turn(c):
                    mine = our_chunk(solo_world, layout, [solo], c)
                with solo_orig.turn(c):
                    alone.chunk()
                worst_solo = max(worst_solo, (mine[0] - alone.outputs[c]).abs().max().item())
                with batch_ours.turn(c):
                    mine = our_chunk(world, layout, ours, c)
                with batch_orig.turn(c):
                    for o in originals:
                        o.chunk()
                diffs = [(mine[i] - o.outputs[c]).abs().max().item() for i, o in enumerate(originals)]
                worst = max(worst, *diffs)
        for o in [alone, *originals]:
            o.close()
        for st in [solo.state, *(o.state for o in ours)]:
            (solo_world if st is solo.state else world).release_state(st)
    batched = ratios(batch_ours, batch_orig)
    return {
        "shape": SHAPE | {"latent": LATENT, "tokens_per_frame": world.tokens_per_frame, "steps": STEPS},
        "chunks": chunks,
        "sessions": sessions,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "load_avg_before": load,
        "load_avg_after": os.getloadavg(),
        "stand_ins": up.stubs,
        "one_session": ratios(solo_ours, solo_orig),
        "batched": batched,
        "batched_total_ratio": sum(batch_ours.wall) / sum(batch_orig.wall),
        "batched_total_cpu_ratio": sum(batch_ours.cpu) / sum(batch_orig.cpu),
        "max_abs_diff": {"one_session": worst_solo, "batched": worst},
    }


def table(report: dict) -> str:
    """The per-chunk table (best of the repeats, ms; ratios ours / original)."""
    a, b = report["one_session"], report["batched"]
    n = report["sessions"]
    lines = [
        f"chunk | 1 session: ours ms  original ms  ratio  cpu ratio | {n} sessions: ours batched ms  "
        f"{n} originals ms  ratio  cpu ratio",
    ]
    for i in range(report["chunks"]):
        lines.append(
            f"{i + 1:5d} | {a['ours_ms'][i]:18.1f} {a['original_ms'][i]:12.1f} {a['ratio'][i]:6.2f} "
            f"{a['cpu_ratio'][i]:10.2f} | {b['ours_ms'][i]:28.1f} {b['original_ms'][i]:15.1f} "
            f"{b['ratio'][i]:6.2f} {b['cpu_ratio'][i]:10.2f}"
        )
    load = report["load_avg_before"][0], report["load_avg_after"][0]
    lines.append(
        f"one session: median ratio {statistics.median(a['ratio']):.2f}, max {max(a['ratio']):.2f} "
        f"(cpu: {statistics.median(a['cpu_ratio']):.2f}, max {max(a['cpu_ratio']):.2f}); "
        f"{n} batched: median {statistics.median(b['ratio']):.2f}, total {report['batched_total_ratio']:.2f} "
        f"(cpu total {report['batched_total_cpu_ratio']:.2f})"
    )
    lines.append(
        f"max abs diff {report['max_abs_diff']['one_session']:.2e} alone, "
        f"{report['max_abs_diff']['batched']:.2e} batched; best of {report['repeats']}, "
        f"{report['threads']} threads, load average {load[0]:.1f} before, {load[1]:.1f} after"
    )
    return "\n".join(lines)


def main() -> None:
    """Run, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="a Self-Forcing checkout")
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="fresh rollouts; each turn's best counts")
    parser.add_argument("--out", type=Path, default=RESULTS / "peer_self_forcing.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = run(args.upstream, args.chunks, args.sessions, args.seed, args.repeats)
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
