"""`worldserve record | rollout | replay` against no server, or with a path that is not there:
one line on stderr and exit status 2, never a traceback (web/datacli.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from web.cli import main
from web.sdk.record import EpisodeWriter


@pytest.fixture
def dead_url() -> str:
    """A loopback address nothing listens on (a port that was just free)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


def recorded(directory: Path) -> Path:
    """A complete (empty) episode directory, as `record` leaves one."""
    meta = {"model": "tiny", "seed": 0, "width": 32, "height": 32, "fps": 15.0, "start_image": False}
    EpisodeWriter(directory, meta, None).close()
    return directory


def one_line(err: str) -> str:
    """The one line a terminal shows (a cleared progress bar leaves nothing: text before a
    carriage return is overwritten)."""
    lines = [line.rsplit("\r", 1)[-1].strip() for line in err.split("\n")]
    lines = [line for line in lines if line]
    assert len(lines) == 1 and lines[0].startswith("worldserve: error: "), err
    return lines[0]


@pytest.mark.parametrize("command", ["record", "rollout", "replay"])
def test_no_server_is_one_line_and_exit_2(
    command: str, dead_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if command == "replay":
        argv = ["replay", str(recorded(tmp_path / "episode-00000")), "--url", dead_url]
    else:
        argv = [command, "--url", dead_url, "--steps", "1", "--out", str(tmp_path / "out")]
        argv += ["--episodes", "1"] if command == "rollout" else []
    assert main(argv) == 2  # the SDK tries for its 5 s connect timeout first
    line = one_line(capsys.readouterr().err)
    assert f"no worldserve server at ws://{dead_url}/v1/session" in line and "Traceback" not in line


def test_replay_of_a_missing_directory_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "missing")]) == 2
    assert one_line(capsys.readouterr().err) == f"worldserve: error: {tmp_path / 'missing'} does not exist"
