"""Golden parity through the served path: the converted tiny Self-Forcing directory, loaded by the
registry and run by a real Engine (batched pool, transactions), replays the original rollout."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.registry import load_world
from runtime import parity
from tests.fixtures.golden import GOLDEN
from tests.fixtures.golden.served import write_self_forcing_dir


@pytest.fixture(scope="module")
def sf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_self_forcing_dir(tmp_path_factory.mktemp("sf"))


def test_served_self_forcing_replays_the_original_rollout(sf_dir: Path) -> None:
    world = load_world(sf_dir)
    golden = parity.load_golden(GOLDEN / "self_forcing_rollout.safetensors")
    result = parity.compare(golden, parity.replay(world, golden))
    assert not result.not_produced
    # every stored output: 3 chunks x (4 steps + ctx) x (input, t, 2 blocks) + 12 flow + 12 x0 + latents
    assert len(result.diffs) == len(golden.outputs) == 85
    assert {"block1.c2.ctx", "x0.c2.s3", "latents", "flow.c0.s0"} <= set(result.diffs)
    name, worst = result.worst
    assert worst < 1e-4, (name, worst)
    assert result.summary(1e-4)["pass"]


def test_a_tampered_golden_fails(sf_dir: Path) -> None:
    world = load_world(sf_dir)
    golden = parity.load_golden(GOLDEN / "self_forcing_rollout.safetensors")
    golden.tensors["block0.c1.s2"] = golden.tensors["block0.c1.s2"] + 1e-3
    result = parity.compare(golden, parity.replay(world, golden))
    assert result.worst[0] == "block0.c1.s2" and result.worst[1] > 1e-4
    assert not result.summary(1e-4)["pass"]


def test_matrix_game_goldens_are_not_supported_yet(sf_dir: Path) -> None:
    world = load_world(sf_dir)
    golden = parity.load_golden(GOLDEN / "matrix_game_universal_rollout.safetensors")
    with pytest.raises(parity.ParityUnsupported, match="matrix-game-2 goldens are not supported yet"):
        parity.replay(world, golden)


def test_the_world_is_restored_after_a_replay(sf_dir: Path) -> None:
    world = load_world(sf_dir)
    golden = parity.load_golden(GOLDEN / "self_forcing_rollout.safetensors")
    parity.replay(world, golden)
    assert not {"noise_batch", "denoise", "context"} & set(vars(world))
    assert all(not blk._forward_hooks for blk in world.transformer.blocks)
