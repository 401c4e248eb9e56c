"""Precomputed prompt embeddings: sha256 file names, index.json, refusals, and the world's
zero padding to its text length (the original attends to every padded row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models import prompts
from models.prompts import PromptEmbeddings, PromptError, prompt_key, save_prompt_embeds


def test_a_prompt_resolves_by_the_sha256_of_its_text(tmp_path: Path) -> None:
    emb = torch.randn(5, 8)
    path = save_prompt_embeds(tmp_path, "a red car", emb)
    assert path.name == f"{prompt_key('a red car')}.safetensors" and len(path.stem) == 64
    store = PromptEmbeddings(tmp_path)
    assert store.problem("a red car") is None
    assert torch.equal(store.embed("a red car"), emb)
    assert "no precomputed embedding" in (store.problem("a blue car") or "")
    with pytest.raises(PromptError):
        store.embed("a blue car")


def test_index_json_maps_prompts_to_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    emb = torch.randn(1, 3, 8)  # a leading batch of one is accepted
    save_file({"prompt_embeds": emb}, str(tmp_path / "castle.safetensors"))
    (tmp_path / "index.json").write_text(json.dumps({"a castle": "castle.safetensors", "escape": "../x"}))
    store = PromptEmbeddings(tmp_path)
    assert torch.equal(store.embed("a castle"), emb[0])
    assert store.problem("escape") is not None  # index entries cannot leave the directory


def test_a_file_holding_another_prompt_is_refused(tmp_path: Path) -> None:
    src = save_prompt_embeds(tmp_path, "one", torch.zeros(2, 4))
    src.rename(tmp_path / f"{prompt_key('two')}.safetensors")
    with pytest.raises(PromptError, match="different prompt"):
        PromptEmbeddings(tmp_path).embed("two")


def test_the_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompts, "CACHE_ENTRIES", 2)
    store = PromptEmbeddings(tmp_path)
    for i in range(4):
        save_prompt_embeds(tmp_path, f"p{i}", torch.full((1, 2), float(i)))
        store.embed(f"p{i}")
    assert list(store._cache) == ["p2", "p3"]


def test_world_pads_prompt_rows_with_zeros_and_refuses_bad_ones(tmp_path: Path) -> None:
    from models.registry import load_world
    from models.world import Conditioning, ConditioningError
    from tests.fixtures.golden import load_golden
    from tests.fixtures.golden.served import write_self_forcing_dir

    world = load_world(write_self_forcing_dir(tmp_path))
    g, meta = load_golden("self_forcing_rollout")
    full = g["prompt_embeds"][0]  # (16, 32): 5 prompt rows, then zero padding
    n = meta["rollout"]["prompt_tokens"]
    save_prompt_embeds(tmp_path / "embeds", "golden", full[:n])  # stored without its padding
    save_prompt_embeds(tmp_path / "embeds", "too wide", torch.zeros(3, 7))
    world.prompts = PromptEmbeddings(tmp_path / "embeds")
    assert torch.equal(world._prompt_text("golden"), full)  # padded back to all 16 rows
    world.setup(2)
    state = world.init_state(Conditioning(seed=1, prompt="golden"))
    pool = world.transformer.pool
    assert int(pool.text_len[state.row]) == full.shape[0]  # every row attended, as the original
    with pytest.raises(ConditioningError, match="text embedding must be"):
        world.init_state(Conditioning(prompt="too wide"))
    with pytest.raises(ConditioningError, match="no precomputed embedding"):
        world.init_state(Conditioning(prompt="unknown"))
    world.prompts = None
    assert "--prompt-embeds" in (world.prompt_problem("golden") or "")
