"""The UMT5 text encoder against the original Wan code: `tests/fixtures/golden/umt5_tiny.safetensors`
(made by make_umt5_golden.py from the original t5.py / tokenizers.py on tiny random weights)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.convert.keymap import ConversionError
from models.umt5.load import (
    ORIGINAL_WEIGHTS,
    TextEncoder,
    diffusers_keymap,
    load_text_encoder,
    original_keymap,
)
from models.umt5.model import UMT5Config, UMT5Encoder
from models.umt5.tokenizer import PromptTooLong, clean_prompt

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden" / "umt5_tiny.safetensors"


def golden() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(GOLDEN), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118


def original_state(g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("weights."): v for k, v in g.items() if k.startswith("weights.")}


def write_original(root: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """The Wan release layout: the .pth state dict and google/umt5-xxl/tokenizer.json."""
    (root / "google" / "umt5-xxl").mkdir(parents=True)
    (root / "google" / "umt5-xxl" / "tokenizer.json").write_text(meta["tokenizer.json"])
    torch.save(original_state(tensors), root / ORIGINAL_WEIGHTS)
    return root


def hf_config(cfg: UMT5Config) -> dict[str, object]:
    return {
        "vocab_size": cfg.vocab,
        "d_model": cfg.dim,
        "num_heads": cfg.heads,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.ffn,
        "num_layers": cfg.layers,
        "relative_attention_num_buckets": cfg.buckets,
        "relative_attention_max_distance": cfg.max_distance,
        "layer_norm_epsilon": cfg.eps,
        "feed_forward_proj": "gated-gelu",
    }


@pytest.fixture(scope="module")
def fixture() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    pytest.importorskip("tokenizers")
    return golden()


@pytest.fixture
def encoder(tmp_path: Path, fixture) -> TextEncoder:
    tensors, meta = fixture
    return load_text_encoder(write_original(tmp_path, tensors, meta), text_len=int(meta["text_len"]))


def test_cleanup_matches_the_original(fixture) -> None:
    _, meta = fixture
    prompts, cleaned = json.loads(meta["prompts"]), json.loads(meta["cleaned"])
    assert [clean_prompt(p) for p in prompts] == cleaned[: len(prompts)]


def test_tokens_and_hidden_states_match_the_original(encoder: TextEncoder, fixture) -> None:
    tensors, meta = fixture
    for i, prompt in enumerate(json.loads(meta["prompts"])):
        n = int(tensors[f"mask.{i}"].sum())
        ids = encoder.ids(prompt)
        assert ids == tensors[f"ids.{i}"][:n].tolist(), prompt
        out = encoder.encode_ids(ids)
        want = tensors[f"out.{i}"]
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, atol=1e-4, rtol=0)


def test_a_prompt_the_original_truncates_is_refused(encoder: TextEncoder, fixture) -> None:
    tensors, meta = fixture
    original = tensors["ids.5"]  # the original: 511 tokens of the prompt, then its EOS
    assert int(tensors["mask.5"].sum()) == 512 and original[-1].item() == 1
    with pytest.raises(PromptTooLong, match=r"at most 512"):
        encoder.ids(meta["too_long"])
    full = encoder.tokenizer.ids(meta["too_long"])
    assert len(full) > 512 and full[:511] == original[:511].tolist()
    with pytest.raises(PromptTooLong, match=r"at most 4"):
        encoder.ids("a red car on a beach", limit=4)  # a world's own, shorter, limit


def test_padded_batch_with_mask_equals_unpadded(encoder: TextEncoder) -> None:
    ids = encoder.ids("a red car on a beach")
    alone = encoder.encode_ids(ids)
    padded = torch.tensor([[*ids, *([0] * 9)]])
    mask = torch.tensor([[1] * len(ids) + [0] * 9])
    with torch.no_grad():
        out = encoder.model(padded, mask)[0, : len(ids)]
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=0)


def test_diffusers_layout_loads_the_same_encoder(tmp_path: Path, encoder: TextEncoder, fixture) -> None:
    tensors, meta = fixture
    cfg = encoder.cfg
    ours_of_original = original_keymap(cfg.layers).rename
    hf_of_ours = {v: k for k, v in diffusers_keymap(cfg.layers).rename.items()}
    hf = {hf_of_ours[ours_of_original[k]]: v for k, v in original_state(tensors).items()}
    hf["encoder.embed_tokens.weight"] = hf["shared.weight"].clone()  # as transformers may save it, tied
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "tokenizer").mkdir()
    save_file(hf, str(tmp_path / "text_encoder" / "model.safetensors"))
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps(hf_config(cfg)))
    (tmp_path / "tokenizer" / "tokenizer.json").write_text(meta["tokenizer.json"])
    other = load_text_encoder(tmp_path)
    assert other.cfg == cfg
    prompt = json.loads(meta["prompts"])[2]
    assert torch.equal(other.encode(prompt), encoder.encode(prompt))


def test_every_key_is_checked(tmp_path: Path, fixture) -> None:
    tensors, meta = fixture
    state = original_state(tensors)
    state["blocks.0.extra.weight"] = torch.zeros(1)
    del state["blocks.1.ffn.fc2.weight"]
    write = {f"weights.{k}": v for k, v in state.items()}
    with pytest.raises(ConversionError, match=r"missing 1: blocks\.1\.ffn\.w2\.weight.*unexpected 1"):
        load_text_encoder(write_original(tmp_path, write, meta))


def test_missing_files_are_named(tmp_path: Path, fixture) -> None:
    _, meta = fixture
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_text_encoder(tmp_path)
    (tmp_path / "tokenizer.json").write_text(meta["tokenizer.json"])
    with pytest.raises(FileNotFoundError, match=re.escape(ORIGINAL_WEIGHTS)):
        load_text_encoder(tmp_path)


def test_published_size() -> None:
    with torch.device("meta"):
        model = UMT5Encoder(UMT5Config())
    count = sum(p.numel() for p in model.parameters())
    assert count == UMT5Config().params()
    assert 5.6e9 < count < 5.8e9
