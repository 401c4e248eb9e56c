"""H.264 quality and bytes on the default world's real frames: the old setting vs the session encoder.

The frames are the model's own: `--seeds` tiny-world sessions (`--chunks` generated chunks, each
holding one of d/s/a/w in turn) through the Engine. Each seed's frames are one H.264 stream
(one session), encoded with

* `old`: libx264 at the model's size, CRF 18 (the setting before codec scaling);
* `new`: `web.encoders.make_encoder` (coded at `ready.codec.scale` x the size, its CRF),
  decoded by the SDK's `ChunkDecoder`, which averages each block back to the model's size;

and compared with the raw frames: PSNR per frame (mean and worst over all frames), total bytes,
and encode CPU ms per frame (one thread).

    python benchmarks/h264_small.py [--model tiny-world] [--seeds 6] [--chunks 8]

Prints and writes benchmarks/results/h264_small.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.actions import FrameAction
from models.registry import DEFAULT_MODEL, from_name
from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest
from web import messages as m
from web.encoders import ChunkDecoder, H264Encoder, make_encoder

RESULTS = Path(__file__).parent / "results"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255**2 / mse))


@torch.no_grad()
def render(model: str, seed: int, chunks: int) -> np.ndarray:
    """(T, H, W, 3) uint8 frames of one session of ``model``."""
    world = from_name(model)
    engine = Engine({world.config.id: world}, max_batch=1)
    engine.add_stream("s", world.config.id, Conditioning(seed=seed))
    keys = "dsaw"
    for i in range(chunks):
        actions = [FrameAction(frozenset({keys[i % 4]}))] * world.chunk_frames
        engine.submit(ChunkRequest("s", engine.new_request_id(), actions=actions))
    parts: dict[int, np.ndarray] = {}
    while engine.has_work():
        for out in engine.step():
            assert isinstance(out, ChunkCommitted)
            parts[out.frame0] = out.frames
    return np.concatenate([parts[k] for k in sorted(parts)])


def measure(encoder: H264Encoder, frames: np.ndarray) -> dict:
    start = time.process_time()
    units = [unit for unit, _ in encoder.encode(frames)]
    encode_ms = (time.process_time() - start) * 1000 / len(frames)
    msg = m.Frames(chunk=1, frame0=0, count=len(units), codec="h264", key=True, data=units)
    decoded = ChunkDecoder("h264", encoder.scale).decode(msg)
    assert decoded.shape == frames.shape
    return {
        "psnr": [psnr(a, b) for a, b in zip(frames, decoded, strict=True)],
        "bytes": sum(len(unit) for unit in units),
        "encode_cpu_ms": encode_ms,
        "coded": f"{encoder.width * encoder.scale}x{encoder.height * encoder.scale}",
        "crf": encoder.crf,
        "codec": encoder.codec_string,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per session (the Engine queues 8)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    size = None
    for seed in range(args.seeds):
        frames = render(args.model, seed, args.chunks)
        _, h, w, _ = frames.shape
        size = f"{w}x{h}"
        runs["old"].append(measure(H264Encoder(w, h, 16, crf=18), frames))
        new = make_encoder("h264", w, h, 16)
        assert isinstance(new, H264Encoder)
        runs["new"].append(measure(new, frames))
    summary = {}
    for name, results in runs.items():
        values = [v for r in results for v in r["psnr"]]
        summary[name] = {
            "psnr_mean_db": round(float(np.mean(values)), 2),
            "psnr_worst_db": round(float(np.min(values)), 2),
            "bytes": sum(r["bytes"] for r in results),
            "encode_cpu_ms_per_frame": round(float(np.mean([r["encode_cpu_ms"] for r in results])), 3),
            "coded": results[0]["coded"],
            "crf": results[0]["crf"],
            "codec": results[0]["codec"],
        }
    out = {
        "model": args.model,
        "size": size,
        "frames": sum(len(r["psnr"]) for r in runs["new"]),
        "seeds": args.seeds,
        "bytes_ratio_new_over_old": round(summary["new"]["bytes"] / summary["old"]["bytes"], 3),
        **summary,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "h264_small.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
