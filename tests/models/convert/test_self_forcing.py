"""Self-Forcing conversion: key map at full size, and the converted tiny golden checkpoint
replays the original causal rollout (3 chunks, 4 steps + context pass each) within 1e-4."""

import json

import pytest
import torch

from models.causal_wan import CausalWan
from models.convert import self_forcing
from models.convert.keymap import ConversionError
from models.sampler import FlowSchedule, add_noise
from runtime.kv_cache import KVLayout
from tests.fixtures.golden import GOLDEN, load_golden


def _original_table(name: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v) for k, v in json.loads((GOLDEN / "original_keys.json").read_text())[name].items()}


def test_full_size_maps_strictly_onto_our_model() -> None:
    table = _original_table("self_forcing_1.3b")
    self_forcing.check_shapes(table)  # raises on any missing / unexpected / mis-shaped key
    assert len(table) == len(self_forcing.target_shapes(self_forcing.model_config({})))


def test_full_size_matches_diffusers_names() -> None:
    from diffusers import WanTransformer3DModel

    cfg = self_forcing.model_config({})
    with torch.device("meta"):
        ref = WanTransformer3DModel(**cfg.diffusers_config())
    assert set(ref.state_dict()) == set(self_forcing.target_shapes(cfg))


def test_errors_name_every_problem() -> None:
    table = _original_table("self_forcing_1.3b")
    del table["model.blocks.3.norm3.weight"]
    table["model.blocks.0.extra.weight"] = (1,)
    table["model.head.head.weight"] = (3, 3)
    with pytest.raises(ConversionError) as err:
        self_forcing.check_shapes(table)
    msg = str(err.value)
    assert "blocks.3.norm2.weight" in msg and "model.blocks.3.norm3.weight" in msg  # missing, with its source
    assert "model.blocks.0.extra.weight" in msg and "model.head.head.weight (3, 3) -> proj_out.weight" in msg


def test_converted_golden_replays_the_original_rollout() -> None:
    g, meta = load_golden("self_forcing_rollout")
    roll, orig = meta["rollout"], meta["config"]
    original = orig | {"local_attn_size": roll["local_attn_size"], "sink_size": roll["sink_size"]}
    state, cfg = self_forcing.convert(GOLDEN / "self_forcing_tiny.pt", original)
    model = CausalWan(cfg).eval()
    model.load_state_dict(state, strict=True)
    sched = FlowSchedule(tuple(roll["denoising_step_list"]), roll["timestep_shift"])
    assert torch.allclose(torch.tensor(sched.timesteps), g["timesteps"], atol=1e-3)

    h, w = roll["latent_hw"]
    tpf, n = (h // 2) * (w // 2), roll["num_frame_per_block"]
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, tpf)
    prompt = g["prompt_embeds"][0]
    worst, out = 0.0, []
    with torch.no_grad():
        pool = model.setup_caches(1, h, w, text_tokens=prompt.shape[0])
        model.set_text(0, prompt)
        for c in range(roll["chunks"]):
            slots = layout.index([0], [c * n], n, pool.pad_row)
            x = g["noise"][:, :, c * n : (c + 1) * n]
            for s, sigma in enumerate(sched.sigmas):
                t = torch.tensor([sched.timesteps[s]])
                flow = model.forward_chunk(x, t, slots)
                x0 = sched.to_x0(flow, x, sigma)
                worst = max(worst, (x0 - g[f"x0.c{c}.s{s}"]).abs().max().item())
                if s + 1 < len(sched.sigmas):
                    x = add_noise(x0, g[f"renoise.c{c}.s{s}"], sched.sigmas[s + 1])
            out.append(x0)
            model.forward_chunk(x0, torch.zeros(1), slots, need_output=False)
    final = (torch.cat(out, dim=2) - g["latents"]).abs().max().item()
    assert worst < 1e-4 and final < 1e-4, (worst, final)


def test_picks_generator_ema() -> None:
    """The converter picks generator_ema (the two state dicts differ in the fixture)."""
    ema = torch.load(GOLDEN / "self_forcing_tiny.pt", weights_only=True)
    assert not torch.equal(
        ema["generator"]["model.head.head.weight"], ema["generator_ema"]["model.head.head.weight"]
    )
    _g, meta = load_golden("self_forcing_rollout")
    state, _ = self_forcing.convert(GOLDEN / "self_forcing_tiny.pt", meta["config"])
    assert torch.equal(state["proj_out.weight"], ema["generator_ema"]["model.head.head.weight"])


def test_published_sizes_are_checked_against_the_weights() -> None:
    with pytest.raises(
        ConversionError, match=r"mis-shaped .*\(64, 64\) -> blocks.0.attn1.to_k.weight \(1536, 1536\)"
    ):
        self_forcing.convert(GOLDEN / "self_forcing_tiny.pt")  # tiny weights, published 1.3B config
