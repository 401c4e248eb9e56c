"""Start `worldserve serve` as a subprocess for the websocket benchmarks (one place for all)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def start_server(model: str, threads: int, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """A server on a free loopback port for `model`; returns the process and its host:port.
    `extra` are more `serve` arguments (e.g. "--max-batch", "8")."""
    cmd = [sys.executable, "-m", "web.cli", "serve", "--model", model, "--port", "0"]
    cmd += ["--threads", str(threads), *extra]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "worldserve: serving M; open http://HOST:PORT"
    if "open " not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split("open ")[1].split()[0].removeprefix("http://")
