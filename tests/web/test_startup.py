"""web/startup.py: the CLI's checks before any model work."""

from pathlib import Path

import pytest
import torch

from web.startup import StartupError, check_bind, check_out, check_port, resolve_device


def test_ports() -> None:
    check_port(0)
    check_port(65535)
    for port in (-1, 65536, 99999):
        with pytest.raises(StartupError, match=f"--port {port}"):
            check_port(port)


def test_bind_needs_a_resolvable_local_address() -> None:
    check_bind("127.0.0.1", 0)
    with pytest.raises(StartupError, match=r"--host no-such-host\.invalid"):
        check_bind("no-such-host.invalid", 0)
    with pytest.raises(StartupError, match=r"cannot listen on 192\.0\.2\.1"):  # TEST-NET-1: not ours
        check_bind("192.0.2.1", 0)


def test_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(StartupError, match="CUDA is not available"):
        resolve_device("cuda:1")
    with pytest.raises(StartupError, match="unsupported"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(StartupError, match="1 CUDA device"):
        resolve_device("cuda:1")


def test_out(tmp_path: Path) -> None:
    check_out(tmp_path / "run.mp4")
    with pytest.raises(StartupError, match="is a directory"):
        check_out(tmp_path)
    with pytest.raises(StartupError, match="does not exist"):
        check_out(tmp_path / "no" / "run.mp4")
