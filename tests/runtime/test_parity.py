"""Golden parity through the served path: the converted tiny Self-Forcing and Matrix-Game 2.0
directories, loaded by the registry and run by a real Engine (batched pool, transactions), replay
the original rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.actions import ActionSpace, FrameAction
from models.registry import load_world
from runtime import parity
from tests.fixtures.golden import GOLDEN
from tests.fixtures.golden.served import write_matrix_game_dir, write_self_forcing_dir

MG = GOLDEN / "matrix_game_universal_rollout.safetensors"


@pytest.fixture(scope="module")
def sf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_self_forcing_dir(tmp_path_factory.mktemp("sf"))


@pytest.fixture(scope="module")
def mg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_matrix_game_dir(tmp_path_factory.mktemp("mg"))


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


def test_served_matrix_game_replays_the_original_rollout(mg_dir: Path) -> None:
    world = load_world(mg_dir)
    golden = parity.load_golden(MG)
    result = parity.compare(golden, parity.replay(world, golden))
    assert not result.not_produced
    # 3 chunks x (3 steps + ctx) x (input, t, 2 blocks) + 9 flow + 9 x0 + latents
    assert len(result.diffs) == len(golden.outputs) == 67
    assert {"block1.c2.ctx", "x0.c2.s2", "latents", "input.c1.ctx"} <= set(result.diffs)
    name, worst = result.worst
    assert worst < 1e-4, (name, worst)


def test_a_tampered_matrix_game_golden_fails(mg_dir: Path) -> None:
    world = load_world(mg_dir)
    golden = parity.load_golden(MG)
    golden.tensors["keyboard"] = 1.0 - golden.tensors["keyboard"]  # other keys held: another rollout
    result = parity.compare(golden, parity.replay(world, golden))
    assert result.worst[1] > 1e-4 and not result.summary(1e-4)["pass"]
    assert result.diffs["input.c0.s0"] == 0.0  # the noise is the golden's; the actions steer it


def test_golden_actions_invert_the_served_mouse_mapping() -> None:
    space = ActionSpace(keys=("w", "s"), mouse=True)
    frames = parity.golden_actions(
        space, torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([[0.02, -0.3], [0, 0]])
    )
    assert frames[0].keys == frozenset("w") and frames[0].mouse == pytest.approx((-30.0, -2.0))
    assert frames[1] == FrameAction()
    with pytest.raises(ValueError, match="mouse"):
        parity.golden_actions(ActionSpace(keys=("w", "s")), torch.zeros(1, 2), torch.zeros(1, 2))


def test_a_golden_of_the_other_conditioning_is_refused(sf_dir: Path, mg_dir: Path) -> None:
    sf = parity.load_golden(GOLDEN / "self_forcing_rollout.safetensors")
    with pytest.raises(
        ValueError, match=r"matrix-game-2\) is image-conditioned, model .* is text-conditioned"
    ):
        parity.replay(load_world(sf_dir), parity.load_golden(MG))
    with pytest.raises(ValueError, match=r"is text-conditioned, model .* is image-conditioned"):
        parity.replay(load_world(mg_dir), sf)


def test_an_unknown_family_is_unsupported(sf_dir: Path) -> None:
    golden = parity.load_golden(MG)
    golden.meta["family"] = "genie-9"
    with pytest.raises(parity.ParityUnsupported, match="genie-9 goldens are not supported"):
        parity.replay(load_world(sf_dir), golden)


def test_the_world_is_restored_after_a_replay(sf_dir: Path) -> None:
    world = load_world(sf_dir)
    golden = parity.load_golden(GOLDEN / "self_forcing_rollout.safetensors")
    parity.replay(world, golden)
    assert not {"noise_batch", "denoise", "context"} & set(vars(world))
    assert all(not blk._forward_hooks for blk in world.transformer.blocks)


def test_a_matrix_game_world_gets_its_conditioner_back(mg_dir: Path) -> None:
    world = load_world(mg_dir)
    conditioner = world.conditioner
    parity.replay(world, parity.load_golden(MG))
    assert world.conditioner is conditioner
