"""WorldVectorEnv(8) vs 8 single WorldEnvs stepped one after another, one run.

`worldserve serve` runs in a subprocess (`--max-batch` 8, so the engine may batch all eight
sessions into one forward). Both sides use the same world seeds and random actions:

* vector: ``WorldVectorEnv(8)``: every ``step`` sends the eight sessions' steps together;
* sequential: eight ``WorldEnv``s, each stepped in turn (one chunk in flight at a time).

The mean batch (sessions per engine step, from the server's ``worldserve_batch_size``
histogram) shows whether the engine really batched the vector env's steps, and the bare engine
(in this process, before the server starts; CPU only) stepping N streams as one batch vs one at
a time gives the most batching can gain on this machine.

Each round times ``--steps`` steps of each side (after a two-step warm-up), alternating the
sides so that background load drifting over the run hits both alike; steps/s counts env steps
(chunks), and the speedup is the median of the per-round ratios.

    python benchmarks/vector_env.py [--model tiny-random] [--steps 10] [--rounds 3] [--threads 1]

Prints and writes benchmarks/results/vector_env.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import start_server
from models.actions import FrameAction
from models.registry import from_name
from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkRequest
from web.sdk.gym_env import WorldEnv
from web.sdk.vector_env import WorldVectorEnv

RESULTS = Path(__file__).parent / "results"
N = 8


def engine_ceiling(model: str, steps: int, threads: int) -> dict[str, float]:
    """Chunks/s of the bare engine (no server, no client) for N streams stepped as one batch of
    N vs one at a time: the most any client-side batching can gain on this machine."""
    torch.set_num_threads(threads)
    world = from_name(model)
    rates = {}
    for batch in (1, N):
        engine = Engine({model: world}, max_batch=batch, max_streams=N)
        for i in range(N):
            engine.add_stream(f"s{i}", model, Conditioning(seed=i))

        def one_round(engine: Engine = engine) -> None:
            for i in range(N):
                engine.submit(ChunkRequest(f"s{i}", engine.new_request_id(), actions=[FrameAction()]))
            while engine.has_work():
                engine.step()

        one_round()  # warm-up (the first chunk is shorter)
        one_round()
        start = time.perf_counter()
        for _ in range(steps):
            one_round()
        rates[f"batch_{batch}_chunks_per_s"] = round(N * steps / (time.perf_counter() - start), 2)
        for i in range(N):  # the world's K/V pool rows go back for the next engine
            engine.remove_stream(f"s{i}")
    rates["speedup"] = round(rates[f"batch_{N}_chunks_per_s"] / rates["batch_1_chunks_per_s"], 2)
    return rates


def batches(url: str) -> tuple[float, float]:
    """(sessions, engine steps) so far, from the server's worldserve_batch_size histogram."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    value = {
        k: float(v)
        for k, v in (line.split(" ") for line in lines if line.startswith("worldserve_batch_size_"))
    }
    return value.get("worldserve_batch_size_sum", 0.0), value.get("worldserve_batch_size_count", 0.0)


def timed(url: str, run) -> tuple[float, float]:
    """(env steps/s, mean sessions per engine step) of ``run()``, which makes N * steps chunks."""
    before = batches(url)
    start = time.perf_counter()
    n = run()
    elapsed = time.perf_counter() - start
    after = batches(url)
    return n / elapsed, (after[0] - before[0]) / max(after[1] - before[1], 1)


def step_vector(envs: WorldVectorEnv, actions: list) -> int:
    for a in actions:
        envs.step(a)
    return N * len(actions)


def step_sequential(singles: list[WorldEnv], actions: list) -> int:
    for a in actions:
        for i, env in enumerate(singles):
            env.step({k: v[i] for k, v in a.items()})
    return N * len(actions)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--device", default="cpu", help="the server's device (default: %(default)s)")
    args = parser.parse_args()

    ceiling = engine_ceiling(args.model, args.steps, args.threads) if args.device == "cpu" else None
    if ceiling is not None:
        print(f"bare engine: {ceiling}")
    proc, url = start_server(args.model, args.threads, "--max-batch", str(N), "--device", args.device)
    try:
        envs = WorldVectorEnv(N, url, args.model)
        singles = [WorldEnv(url, args.model) for _ in range(N)]
        envs.action_space.seed(0)
        steps = args.rounds * (args.steps + 2)
        actions = [envs.action_space.sample() for _ in range(steps)]
        envs.reset(seed=0)
        for i, env in enumerate(singles):
            env.reset(seed=i)
        vector, sequential, vector_batch, sequential_batch = [], [], [], []
        for r in range(args.rounds):
            chunk = actions[r * (args.steps + 2) : (r + 1) * (args.steps + 2)]
            step_vector(envs, chunk[:2])  # warm-up
            rate, batch = timed(url, lambda c=chunk: step_vector(envs, c[2:]))
            vector.append(rate)
            vector_batch.append(batch)
            step_sequential(singles, chunk[:2])
            rate, batch = timed(url, lambda c=chunk: step_sequential(singles, c[2:]))
            sequential.append(rate)
            sequential_batch.append(batch)
            print(
                f"round {r + 1}: vector {vector[-1]:.1f} steps/s (batch {vector_batch[-1]:.1f}), "
                f"sequential {sequential[-1]:.1f} steps/s (batch {sequential_batch[-1]:.1f})"
            )
        envs.close()
        for env in singles:
            env.close()
    finally:
        proc.terminate()
        proc.wait(30)

    ratios = [v / s for v, s in zip(vector, sequential, strict=True)]
    result = {
        "benchmark": "vector_env",
        "model": args.model,
        "num_envs": N,
        "server_max_batch": N,
        "server_threads": args.threads,
        "server_device": args.device,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "vector_steps_per_s": [round(v, 2) for v in vector],
        "sequential_steps_per_s": [round(s, 2) for s in sequential],
        "vector_steps_per_s_median": round(statistics.median(vector), 2),
        "sequential_steps_per_s_median": round(statistics.median(sequential), 2),
        "speedup_median": round(statistics.median(ratios), 2),
        "vector_mean_batch": [round(b, 2) for b in vector_batch],
        "sequential_mean_batch": [round(b, 2) for b in sequential_batch],
        "speedup_per_round": [round(x, 2) for x in ratios],
        "target_speedup": 3.0,
        "bare_engine_ceiling": ceiling,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "numpy": np.__version__},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vector_env.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"vector_env: WorldVectorEnv({N}) {result['vector_steps_per_s_median']} steps/s vs {N} sequential "
        f"WorldEnvs {result['sequential_steps_per_s_median']} steps/s: {result['speedup_median']}x "
        f"(target 3x) -> {RESULTS / 'vector_env.json'}"
    )


if __name__ == "__main__":
    main()
