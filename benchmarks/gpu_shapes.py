"""Full-size shapes on one GPU: Wan2.1-1.3B causal family at Matrix-Game 2.0 and Self-Forcing shapes.

One prepared command for a lent H200 (random weights: FLOPs do not depend on them; bf16):

    python benchmarks/gpu_shapes.py --out $OUT/gpu_shapes.json            # ~8 min, JSON after every run
    python benchmarks/gpu_shapes.py --device cpu --tiny --out /tmp/g.json  # the same code path, scaled down

Runs, in priority order until `--budget-s` is spent (each row is written as soon as it is done):

* `engine`: N sessions through a bare `Engine` (one batched forward per step): per-stage ms per
  chunk from the runner's CUDA events, frames/s in total and per session, decode included;
  for N = 1, 2, 4, 8, eager vs compiled (`torch.compile`, fullgraph, one graph per batch
  bucket) vs CUDA graphs (`mode="reduce-overhead"`), Wan VAE vs the TAEHV decoder;
* `overlap`: the bare batched loop with each chunk's decode on a second CUDA stream while the
  next chunk denoises, against the same loop serial (what item 6's pipelining would buy);
* `engine_overlap`: the same through the Engine with every chunk queued up front (realtime and
  generate streams keep chunks queued), `pipeline=False` vs `True` (the served `--overlap-decode`);
* `latency`: one lockstep session through the Engine, ms from a chunk's submit to its commit
  (what a client waits for its frames, network aside), p50 / p90: pipelined (the CUDA default),
  serial with the clean pass before the frames, serial with it after (`--defer-clean-pass`);
* `forward`: the bare chunk forward per batch size (ms), eager and compiled;
* `attention`: one layer's pool self-attention, masked 4-D SDPA vs FlexAttention
  (benchmarks/attention.py), at the full shapes.

Targets (one H200): MG shape >= 50 FPS one session with the Wan VAE; 8 sessions >= 100 FPS in
total with the fast decoder; SF shape >= 34 FPS. Published (H100): MG 25 FPS, SF 17 FPS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import attention
from models.causal_wan import ActionConfig, CausalWanConfig
from models.registry import build_world
from models.sampler import FlowSchedule, add_noise
from models.taehv import TAEHV, TAEHVConfig, TAEHVDecoder
from models.vae import decode_batch
from models.world import Conditioning, World, WorldConfig
from runtime.engine import Engine
from runtime.kv_cache import KVLayout
from runtime.requests import ChunkCommitted, ChunkRequest

PUBLISHED_FPS = {"mg": 25.0, "sf": 17.0}  # one H100, as the Self-Forcing and Matrix-Game 2.0 papers report
MODES = {"eager": None, "compiled": "default", "graphs": "reduce-overhead"}


def shape_configs(shape: str, tiny: bool) -> tuple[WorldConfig, CausalWanConfig, dict]:
    """Wan2.1-1.3B (dim 1536, 30 layers) at the MG or SF shape; `tiny` scales everything down."""
    if shape == "mg":
        width, height, steps, window = 640, 352, (1000, 666, 333), 6
        action = ActionConfig(
            keys=("w", "a", "s", "d"),
            mouse=True,
            frames_per_latent=4,
            blocks=15,
            key_dim=1024,
            motion_dim=1024,
        )
    else:
        width, height, steps, window = 832, 480, (1000, 750, 500, 250), 21
        action = None
    dit = CausalWanConfig(
        chunk_frames=3, window_frames=window, text_dim=4096, null_text_len=512, action=action
    )
    vae: dict = {}  # AutoencoderKLWan defaults: Wan2.1's VAE
    if tiny:
        width, height = 64, 64
        dit = CausalWanConfig(
            num_attention_heads=2,
            attention_head_dim=32,
            ffn_dim=128,
            num_layers=4,
            text_dim=32,
            freq_dim=32,
            chunk_frames=3,
            window_frames=window,
            null_text_len=8,
            action=None
            if action is None
            else ActionConfig(
                keys=action.keys, frames_per_latent=4, blocks=2, key_dim=32, motion_dim=32, heads=2
            ),
        )
        vae = {"base_dim": 8, "dim_mult": [1, 2, 2, 2]}
    world = WorldConfig(id=shape, fps=16.0, width=width, height=height, schedule=FlowSchedule(steps=steps))
    return world, dit, vae


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def with_taehv(world: World, tiny: bool) -> World:
    """The same world (shared transformer and pool) decoding with a random-weight TAEHV."""
    cfg = TAEHVConfig(dec_widths=(16, 16, 16, 16), enc_width=16) if tiny else TAEHVConfig()
    dec = TAEHVDecoder(TAEHV(cfg).to(world.device, world.dtype))
    return World(world.config, world.transformer, dec, device=world.device, dtype=world.dtype)


def compile_world(world: World, mode: str, buckets: tuple[int, ...]) -> None:
    """Put `world` in eager / compiled / graphs mode (dynamo is reset between modes)."""
    import torch._dynamo as dynamo

    dynamo.reset()
    if MODES[mode] is None:
        world.buckets = None
        world._denoise_fn, world._context_fn = world._eager_denoise, world._eager_context
    else:
        world.compile(buckets, mode=None if MODES[mode] == "default" else MODES[mode])


def engine_run(
    world: World, sessions: int, chunks: int, pipeline: bool | None = None, queued: bool = False
) -> dict:
    """N sessions through a bare Engine: stage ms (runner's CUDA events), frames/s. Lockstep (one
    chunk per session at a time) or, `queued`, every measured chunk submitted up front."""
    engine = Engine(
        {world.config.id: world}, max_batch=sessions, max_streams=max(8, sessions), pipeline=pipeline
    )
    for i in range(sessions):
        engine.add_stream(f"s{i}", world.config.id, Conditioning(seed=i))
    per_chunk: list[dict] = []
    frames, t_start = 0, 0.0

    def drain(measured: bool) -> None:
        nonlocal frames
        while engine.has_work():
            for o in engine.step():
                assert isinstance(o, ChunkCommitted), o
                if measured:
                    per_chunk.append(o.timings.as_dict())
                    frames += o.frames.shape[0]

    rounds = [1] * (chunks + 2) if not queued else [1, 1, chunks]
    for c, n in enumerate(rounds):  # two warm-up chunks (compile / graph capture, first-chunk shape)
        if c == 2:
            sync(world.device)
            t_start, frames = time.perf_counter(), 0
        for _ in range(n):
            for i in range(sessions):
                engine.submit(ChunkRequest(f"s{i}", engine.new_request_id()))
        drain(c >= 2)
    sync(world.device)
    elapsed = time.perf_counter() - t_start
    for i in range(sessions):
        engine.remove_stream(f"s{i}")
    stages = {k: round(sum(t[k] for t in per_chunk) / len(per_chunk), 2) for k in per_chunk[0]}
    return {
        "stage_ms_mean": stages,
        "fps_total": round(frames / elapsed, 2),
        "fps_per_session": round(frames / elapsed / sessions, 2),
    }


def lockstep_latency(world: World, chunks: int, pipeline: bool, defer: bool) -> dict:
    """One lockstep session: ms from each chunk's submit to its `ChunkCommitted`, after two
    warm-up chunks. A clean pass owed after the commit runs before the next submit, as it does in
    a server while the frames travel and the client answers."""
    engine = Engine({world.config.id: world}, max_batch=1, pipeline=pipeline, defer_context=defer)
    engine.add_stream("s", world.config.id, Conditioning(seed=0))
    ms: list[float] = []
    for c in range(chunks + 2):
        t0 = time.perf_counter()
        engine.submit(ChunkRequest("s", engine.new_request_id()))
        done = False
        while not done:
            done = any(isinstance(o, ChunkCommitted) for o in engine.step())
        if c >= 2:
            ms.append((time.perf_counter() - t0) * 1000)
        while engine.has_work():
            engine.step()
    engine.remove_stream("s")
    ms.sort()
    return {"submit_to_commit_ms_p50": round(ms[len(ms) // 2], 2), "p90": round(ms[int(len(ms) * 0.9)], 2)}


def bare_loop(world: World, sessions: int, chunks: int, overlap: bool) -> float:
    """Frames/s of the batched model loop; with `overlap`, decode runs on a second CUDA stream
    while the next chunk denoises (the frames of chunk k are only read after chunk k+1 began)."""
    cfg = world.transformer.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, world.tokens_per_frame)
    world.setup(max(8, sessions))
    states = [world.init_state(Conditioning(seed=i)) for i in range(sessions)]
    sched, n = world.config.schedule, world.chunk_frames
    a = cfg.action
    acts = None
    if a is not None:
        width = len(a.keys) + 2 * int(a.mouse) + a.vector_dim
        acts = torch.zeros(sessions, n, world.layout.frames_per_latent, width, device=world.device)
    side = torch.cuda.Stream() if overlap else None
    caches = [s.decoder for s in states]
    done = [0] * sessions
    frames, t0, pending = 0, 0.0, None
    for c in range(chunks + 2):
        if c == 2:
            sync(world.device)
            t0, frames = time.perf_counter(), 0
        index = layout.index([s.row for s in states], done, n, world.pad_row, device=world.device)
        x = world.noise_batch([(s.seed, c + 1, 0) for s in states], n)
        for k, (t, sg) in enumerate(zip(sched.timesteps, sched.sigmas, strict=True)):
            x0 = sched.to_x0(world.denoise(x, t, index, acts), x, sg)
            if k + 1 < len(sched.steps):
                x = add_noise(
                    x0, world.noise_batch([(s.seed, c + 1, k + 1) for s in states], n), sched.sigmas[k + 1]
                )
        x0 = world.canonical(x0)
        world.context(x0, index, acts)
        if pending is not None:  # the previous chunk's frames: wait for them only now
            out = pending()
            frames += sum(f.shape[0] for f in out)
        if side is not None:
            ready = torch.cuda.Event()
            ready.record()
            side.wait_event(ready)
            with torch.cuda.stream(side):
                out, caches = decode_batch(world.decoder, x0, caches)
                host = [f.to("cpu", non_blocking=True) for f in out]
                done_ev = torch.cuda.Event()
                done_ev.record(side)
            x0.record_stream(side)

            def pending(ev=done_ev, host=host):
                ev.synchronize()
                return host
        else:
            out, caches = decode_batch(world.decoder, x0, caches)
            frames += sum(f.cpu().shape[0] for f in out)
        done = [d + n for d in done]
    if pending is not None:
        frames += sum(f.shape[0] for f in pending())
    sync(world.device)
    elapsed = time.perf_counter() - t0
    for s in states:
        world.release_state(s)
    return frames / elapsed


def forward_ms(world: World, sessions: int, reps: int) -> float:
    """Milliseconds of one batched denoise forward for `sessions` entries."""
    cfg = world.transformer.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, world.tokens_per_frame)
    world.setup(max(8, sessions))
    states = [world.init_state(Conditioning(seed=i)) for i in range(sessions)]
    n = world.chunk_frames
    b = world.bucket(sessions) or sessions
    rows = [s.row for s in states]
    index = layout.index(rows, [cfg.window_frames] * sessions, n, world.pad_row, b, world.device)
    a = cfg.action
    acts = None
    if a is not None:
        width = len(a.keys) + 2 * int(a.mouse) + a.vector_dim
        acts = torch.zeros(b, n, world.layout.frames_per_latent, width, device=world.device)
    x = world.noise_batch([(i, 1, 0) for i in range(sessions)] + [None] * (b - sessions), n)
    for _ in range(3):
        world.denoise(x, 500.0, index, acts)
    sync(world.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        world.denoise(x, 500.0, index, acts)
    sync(world.device)
    for s in states:
        world.release_state(s)
    return (time.perf_counter() - t0) * 1000 / reps


def plan(tiny: bool) -> list[tuple]:
    """(kind, shape, mode, decoder, sessions) in priority order: what answers the targets first."""
    runs: list[tuple] = [
        ("engine", "mg", "eager", "wan", 1),
        ("engine", "mg", "eager", "taehv", 1),
        ("engine", "mg", "eager", "taehv", 8),
        ("forward", "mg", "eager", None, 1),
        ("forward", "mg", "eager", None, 8),
        ("attention", "mg", "eager", None, 8),
        ("attention", "sf", "eager", None, 1),
        ("engine", "mg", "graphs", "wan", 1),
        ("engine", "mg", "graphs", "taehv", 1),
        ("engine", "mg", "graphs", "taehv", 8),
        ("forward", "mg", "graphs", None, 1),
        ("forward", "mg", "graphs", None, 8),
        ("overlap", "mg", "graphs", "wan", 1),
        ("overlap", "mg", "graphs", "taehv", 8),
        ("engine_overlap", "mg", "graphs", "wan", 1),
        ("engine_overlap", "mg", "graphs", "taehv", 8),
        ("latency", "mg", "graphs", "taehv", 1),
        ("engine", "sf", "eager", "wan", 1),
        ("engine", "sf", "graphs", "wan", 1),
        ("engine", "sf", "graphs", "taehv", 1),
        ("engine", "mg", "eager", "taehv", 2),
        ("engine", "mg", "eager", "taehv", 4),
        ("engine", "mg", "compiled", "taehv", 1),
        ("engine", "mg", "compiled", "taehv", 8),
        ("engine", "mg", "graphs", "taehv", 2),
        ("engine", "mg", "graphs", "taehv", 4),
    ]
    if tiny:  # on a CPU: no CUDA graphs, no second stream; inductor compiles slowly
        runs = [r for r in runs if r[0] != "overlap" and r[2] != "graphs"]
        runs += [("engine_overlap", "mg", "eager", "taehv", 2), ("latency", "mg", "eager", "taehv", 1)]
        runs = [r for r in runs if not (r[2] == "compiled" and r[4] == 8)]
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", type=int, default=6, help="measured chunks per session per run")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new runs after this")
    p.add_argument(
        "--tiny", action="store_true", help="scaled-down configs: checks the script, measures nothing"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_shapes.json")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    start = time.perf_counter()
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "tiny": args.tiny,
        "command": " ".join(sys.argv),
    }
    results: list[dict] = []
    worlds: dict[str, dict[str, World]] = {}
    mode_of: dict[str, str] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for kind, shape, mode, decoder, n in plan(args.tiny):
        row: dict = {"kind": kind, "shape": shape, "mode": mode, "decoder": decoder, "sessions": n}
        if time.perf_counter() - start > args.budget_s:
            results.append(row | {"skipped": "time budget spent"})
            continue
        if kind == "attention":  # one layer's self-attention: masked SDPA vs FlexAttention, no world
            t_run = time.perf_counter()
            try:
                row |= attention.measure("tiny-world" if args.tiny else shape, n, device, dtype, reps=5)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            row["wall_s"] = round(time.perf_counter() - t_run, 1)
            print(json.dumps(row), flush=True)
            results.append(row)
            args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
            continue
        if shape not in worlds:
            worlds.clear()  # one full-size shape on the device at a time
            if device.type == "cuda":
                torch.cuda.empty_cache()
            wcfg, dit, vae = shape_configs(shape, args.tiny)
            wan = build_world(wcfg, dit, vae, seed=0, device=device, dtype=dtype)
            worlds[shape] = {"wan": wan, "taehv": with_taehv(wan, args.tiny)}
            mode_of[shape] = ""
        pair = worlds[shape]
        t_run = time.perf_counter()
        try:
            if mode_of[shape] != mode:
                for w in pair.values():
                    compile_world(w, mode, (1, 2, 4, 8))
                mode_of[shape] = mode
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                if kind == "engine":
                    row |= engine_run(pair[decoder], n, args.chunks)
                elif kind == "overlap":
                    serial = bare_loop(pair[decoder], n, args.chunks, overlap=False)
                    piped = bare_loop(pair[decoder], n, args.chunks, overlap=True)
                    row |= {"fps_serial": round(serial, 2), "fps_decode_on_side_stream": round(piped, 2)}
                elif kind == "engine_overlap":
                    for name, on in (("serial", False), ("pipelined", True)):
                        row[name] = engine_run(pair[decoder], n, args.chunks, pipeline=on, queued=True)
                elif kind == "latency":
                    for name, piped, defer in (
                        ("pipelined", True, False),
                        ("serial_pass_first", False, False),
                        ("serial_pass_after", False, True),
                    ):
                        row[name] = lockstep_latency(pair[decoder], 3 * args.chunks, piped, defer)
                else:
                    row["forward_ms"] = round(forward_ms(pair["wan"], n, reps=5), 2)
            w = pair["wan"]
            row |= {
                "resolution": f"{w.config.height}x{w.config.width}",
                "steps": len(w.config.schedule.steps),
                "kv_bytes_per_session": w.kv_bytes_per_session(),
                "published_fps_h100": PUBLISHED_FPS[shape],
            }
            if device.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        except Exception as exc:  # one failing configuration must not lose the others' numbers
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["wall_s"] = round(time.perf_counter() - t_run, 1)
        print(json.dumps(row), flush=True)
        results.append(row)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
