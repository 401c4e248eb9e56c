"""Checks the CLI runs before any model work, so a bad flag costs one line, not a model load.

Each check raises :class:`StartupError` with a message meant to be printed as one line on
stderr (the CLI exits with status 2, as argparse does for bad usage). Nothing here imports torch
at module level: the parser uses this module, and `worldserve --help` must not wait for torch.
"""

import argparse
import os
import re
import socket
from pathlib import Path

__all__ = [
    "DTYPES",
    "StartupError",
    "check_bind",
    "check_out",
    "check_port",
    "parse_size",
    "resolve_device",
    "resolve_dtype",
]

DTYPES = ("float32", "bfloat16", "float16")  # --dtype values besides auto (torch dtype names)
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class StartupError(Exception):
    """A setting the process cannot start with; ``str(exc)`` is the one line to print."""


def check_port(port: int) -> None:
    """``port`` is a TCP port (0 picks a free one)."""
    if not 0 <= port <= 65535:
        raise StartupError(f"--port {port}: a port is 0..65535 (0 picks a free one)")


def check_bind(host: str, port: int) -> None:
    """``host``:``port`` can be listened on now: resolvable, a local address, not in use.

    The probe socket sets SO_REUSEADDR as the server's listener does, so a port held only by
    connections in TIME_WAIT passes, and a port another process listens on does not.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host}: cannot resolve it ({exc.strerror})") from exc
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def resolve_device(device: str) -> str:
    """The torch device to load worlds on: ``auto`` is CUDA when present, else the CPU.

    ``cuda`` / ``cuda:N`` must name a GPU this process can use; other names must be ``cpu``.
    """
    import torch  # here, not at the top: the parser imports this module

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise StartupError(f"--device {device}: not a device (auto, cpu, cuda or cuda:N)") from exc
    if parsed.type == "cpu":
        return device
    if parsed.type != "cuda":
        raise StartupError(f"--device {device}: unsupported (auto, cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise StartupError(f"--device {device}: CUDA is not available here (use --device cpu or auto)")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise StartupError(f"--device {device}: this machine has {count} CUDA device(s)")
    return device


def check_out(path: Path) -> None:
    """``path`` can be written: its directory exists and is writable, and it is not a directory."""
    folder = path.parent
    if not folder.is_dir():
        raise StartupError(f"--out {path}: directory {folder} does not exist")
    if path.is_dir():
        raise StartupError(f"--out {path}: is a directory; give a file name, e.g. {path / 'run.mp4'}")
    if not os.access(folder, os.W_OK):
        raise StartupError(f"--out {path}: directory {folder} is not writable")


def resolve_dtype(dtype: str, device: str) -> str:
    """The weights' dtype name: ``auto`` is bfloat16 on CUDA (half the memory of float32, and the
    tensor cores' type) and float32 elsewhere (CPUs run bfloat16 slowly, if at all)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def parse_size(text: str) -> int:
    """Bytes in a size such as ``40GiB``, ``512MB`` or ``1073741824`` (an argparse ``type``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; e.g. 40GiB, 512MiB, 8GB or a byte count")
    size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return size
