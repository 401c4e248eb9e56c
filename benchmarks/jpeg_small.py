"""JPEG quality, bytes and encode time on the default world's real frames: old setting vs session encoder.

The frames are the model's own, rendered as in benchmarks/h264_small.py (`--seeds` tiny-world
sessions of `--chunks` chunks under held keys). Every frame is encoded with

* `old`: 4:2:0 at quality 90 (the setting before small worlds kept their chroma);
* `new`: `web.encoders.make_encoder("jpeg", ...)` (`jpeg_settings`: 4:4:4 at quality 96 below
  128 px), decoded by the SDK's `ChunkDecoder`;

and compared with the raw frames: PSNR per frame (mean and worst), bytes per frame, and encode
and decode CPU ms per frame (one thread, the best of `--repeats` passes).

    python benchmarks/jpeg_small.py [--model tiny-world] [--seeds 6] [--chunks 8] [--repeats 5]

Prints and writes benchmarks/results/jpeg_small.json.
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

from benchmarks.h264_small import psnr, render
from models.registry import DEFAULT_MODEL
from web import messages as m
from web.encoders import ChunkDecoder, JpegEncoder, make_encoder

RESULTS = Path(__file__).parent / "results"


def cpu_ms_per_frame(fn, frames: np.ndarray, repeats: int) -> float:
    """The best of ``repeats`` passes of ``fn(frames)``, in CPU ms per frame."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn(frames)
        best = min(best, time.process_time() - start)
    return best * 1000 / len(frames)


def measure(encoder: JpegEncoder, frames: np.ndarray, repeats: int) -> dict:
    payloads = [payload for payload, _ in encoder.encode(frames)]
    msg = m.Frames(chunk=1, frame0=0, count=len(payloads), codec="jpeg", key=True, data=payloads)
    decoder = ChunkDecoder("jpeg")
    decoded = decoder.decode(msg)
    assert decoded.shape == frames.shape
    values = [psnr(a, b) for a, b in zip(frames, decoded, strict=True)]
    return {
        "quality": encoder.quality,
        "subsampling": encoder.subsampling,
        "psnr_mean_db": round(float(np.mean(values)), 2),
        "psnr_worst_db": round(float(np.min(values)), 2),
        "bytes_per_frame": round(sum(len(p) for p in payloads) / len(payloads)),
        "encode_cpu_ms_per_frame": round(cpu_ms_per_frame(encoder.encode, frames, repeats), 3),
        "decode_cpu_ms_per_frame": round(cpu_ms_per_frame(lambda _: decoder.decode(msg), frames, repeats), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per session (the Engine queues 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timing passes (the best counts)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    frames = np.concatenate([render(args.model, seed, args.chunks) for seed in range(args.seeds)])
    _, h, w, _ = frames.shape
    new = make_encoder("jpeg", w, h, 16)
    assert isinstance(new, JpegEncoder)
    old = measure(JpegEncoder(90, "4:2:0"), frames, args.repeats)
    out = {
        "model": args.model,
        "size": f"{w}x{h}",
        "frames": len(frames),
        "seeds": args.seeds,
        "old": old,
        "new": measure(new, frames, args.repeats),
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
    }
    out["bytes_ratio_new_over_old"] = round(out["new"]["bytes_per_frame"] / old["bytes_per_frame"], 3)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "jpeg_small.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
