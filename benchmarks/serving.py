"""Start `worldserve serve` as a subprocess for the websocket benchmarks, and write their results
(one place for all)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def report(out: Path, benchmark: str, **fields: object) -> None:
    """Write a benchmark's result to `out` as JSON and print it: its name, the command, the
    machine, then `fields`."""
    result = {
        "benchmark": benchmark,
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        **fields,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def start_server(
    model: str, threads: int, *extra: str, root: Path | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """A server on a free loopback port for `model`; returns the process and its host:port.
    `extra` are more `serve` arguments (e.g. "--max-batch", "8"); `root`: the checkout whose code
    serves (default: this one; another one for a before/after run), `env`: the server's
    environment (default: this process's)."""
    cmd = [sys.executable, "-m", "web.cli", "serve", "--model", model, "--port", "0"]
    cmd += ["--threads", str(threads), *extra]
    root = root or Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "worldserve: serving M; open http://HOST:PORT"
    if "open " not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split("open ")[1].split()[0].removeprefix("http://")
