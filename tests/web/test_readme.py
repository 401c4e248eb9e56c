"""README.md's examples, run as written against the server the README starts (`worldserve serve`:
the registry's default world), as a real process on a free loopback port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
DOCUMENTED = "127.0.0.1:8000"  # the address the README's examples use


def blocks(lang: str) -> list[str]:
    """The README's fenced code blocks in ``lang``."""
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """``HOST:PORT`` of `worldserve serve` with its defaults (on a free port instead of 8000)."""
    cmd = [sys.executable, "-m", "web.cli", "serve", "--port", "0", "--threads", "1"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert "open http://" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield line.split("open http://")[1].split()[0]
    finally:
        proc.kill()
        proc.wait()


def test_the_readme_serves_the_default_world_and_has_sdk_examples() -> None:
    assert "worldserve serve" in blocks("bash")[0]
    assert len(blocks("python")) >= 2


def test_the_readme_says_how_to_get_cpu_torch_and_run_the_browser_tests() -> None:
    quick_start = README.split("\n## ", 1)[0]  # the top section, where the test command is
    assert "pytest -q" in quick_start
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in quick_start
    assert "apt-get install chromium" in quick_start and "CI=true" in quick_start


def test_the_first_command_installs_the_cpu_torch_before_worldserve() -> None:
    """A CPU user runs the lines in order: the CPU wheel must come before `pip install -e .`,
    which would otherwise pull pip's default (CUDA) torch."""
    first = blocks("bash")[0]
    cpu = first.find("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert 0 <= cpu < first.find("pip install -e .")


def test_every_benchmark_file_the_docs_name_exists() -> None:
    """The docs cite benchmark scripts and their results; pruning `benchmarks/results` must not
    leave a citation without its file."""
    card = ROOT / "models/tiny_world/MODEL_CARD.md"
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), card]
    cited = {
        (doc.name, name)
        for doc in docs
        for name in re.findall(r"benchmarks/(?:results/)?[\w.-]+\.(?:py|jsonl?|png|mp4)", doc.read_text())
    }
    assert len(cited) > 20
    missing = sorted((doc, name) for doc, name in cited if not (ROOT / name).is_file())
    assert not missing


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_example_runs_as_written(address: str, index: int) -> None:
    code = blocks("python")[index]
    assert DOCUMENTED in code, "examples talk to the documented server"
    run = subprocess.run(
        [sys.executable, "-c", code.replace(DOCUMENTED, address)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_default_world_commands_run_as_written(tmp_path: Path) -> None:
    (block,) = [b for b in blocks("bash") if "python -m models.game" in b]
    lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    commands = [line for line in lines if line and ".train" not in line]  # retraining takes an hour
    assert len(commands) == 2
    for command in commands:
        program, rest = command.split(" ", 1)
        command = (
            {"worldserve": f"{sys.executable} -m web.cli", "python": sys.executable}[program] + " " + rest
        )
        run = subprocess.run(
            command, shell=True, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, (command, run.stderr[-2000:])
    assert (tmp_path / "sim" / "sim.npz").exists() and (tmp_path / "model.mp4").stat().st_size > 0
