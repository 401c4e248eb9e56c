"""web/datacli: `worldserve record`, `replay` and `rollout` against a live loopback server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from web.cli import main
from web.sdk.record import read_episode

from .conftest import serving_in_thread


@pytest.fixture(scope="module")
def url(worlds):
    with serving_in_thread(worlds, max_batch=8) as server:
        yield server.url


def test_rollout_writes_episodes_and_resumes(url, tmp_path, capsys) -> None:
    args = [
        "rollout",
        "--url",
        url,
        "--episodes",
        "3",
        "--steps",
        "2",
        "--concurrency",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr()
    # 3 episodes of 3 + 4 frames
    assert "rollout: 3 episodes (0 already done), 21 frames" in out.out and "frames/s" in out.out
    assert "chunk" in out.err  # the progress bar
    eps = [read_episode(tmp_path / f"episode-{i:05d}") for i in range(3)]
    assert [e.meta["seed"] for e in eps] == [0, 1, 2] and all(e.meta["chunks"] == 2 for e in eps)
    # an unfinished episode is run again, finished ones are skipped
    (tmp_path / "episode-00001" / "meta.json").unlink()
    before = (tmp_path / "episode-00000" / "frames.npz").stat().st_mtime_ns
    assert main([*args, "--episodes", "4"]) == 0
    assert "rollout: 2 episodes (2 already done)" in capsys.readouterr().out
    assert (tmp_path / "episode-00000" / "frames.npz").stat().st_mtime_ns == before
    assert read_episode(tmp_path / "episode-00003").meta["seed"] == 3
    # every rollout episode replays (alone now, so compared by PSNR if batching moved a value)
    assert main(["replay", str(tmp_path), "--url", url]) in (0, 1)
    assert capsys.readouterr().out.count("replay: 2 chunks") == 4


def test_record_and_replay_commands(url, tmp_path, capsys) -> None:
    policy = tmp_path / "walk.py"
    policy.write_text(
        "import numpy as np\n"
        "def policy(obs, t, action_space):\n"
        "    return {'keys': np.array([1, 0, 0, t % 2, 0])}\n"
    )
    out = tmp_path / "ep"
    assert (
        main(
            [
                "record",
                "--url",
                url,
                "--steps",
                "4",
                "--seed",
                "3",
                "--policy",
                f"script:{policy}",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in (out / "episode-00000" / "actions.jsonl").read_text().splitlines()]
    assert [x["actions"][0]["keys"] for x in lines] == [["w"], ["w", "d"], ["w"], ["w", "d"]]
    capsys.readouterr()
    assert main(["replay", str(out / "episode-00000"), "--url", url]) == 0
    assert "bit-identical" in capsys.readouterr().out


def test_bad_policy_and_missing_episode(url, tmp_path, capsys) -> None:
    assert main(["rollout", "--url", url, "--policy", "greedy", "--out", str(tmp_path)]) == 2
    assert "--policy must be" in capsys.readouterr().err
    assert main(["rollout", "--url", url, "--concurrency", "0", "--out", str(tmp_path)]) == 2
    assert main(["replay", str(tmp_path), "--url", url]) == 2


@pytest.mark.slow  # about a minute on 2 cores: 16 x 20 chunks of the default world, then 50 more
def test_the_readme_rollout_commands_run_as_written(tmp_path) -> None:
    """README's Robotics commands against `worldserve serve` (the default world) on a free port:
    the same commands, with that port as --url."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "worldserve rollout" in b]
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    serve, commands = lines[0], lines[1:]
    assert serve.startswith("worldserve serve") and serve.endswith("&")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "web.cli", *serve[len("worldserve ") : -1].split(), "--port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert "open http://" in line, line
        address = line.split("open http://")[1].split()[0]
        for command in commands:
            parts = [
                re.sub(r"^worldserve (\w+)", rf"{sys.executable} -m web.cli \1 --url {address}", c.strip())
                for c in command.split("&&")
            ]
            run = subprocess.run(
                " && ".join(parts),
                shell=True,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert run.returncode == 0, (command, run.stdout[-1000:], run.stderr[-2000:])
    finally:
        proc.kill()
        proc.wait()
    assert len(list((tmp_path / "episodes").glob("episode-*/meta.json"))) == 16
    assert "bit-identical" in run.stdout  # the last command: record one episode, replay it --exact
