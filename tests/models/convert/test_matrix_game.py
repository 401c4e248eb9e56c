"""Matrix-Game 2.0 conversion: the three published variants map strictly at full size, and the
converted tiny golden checkpoint's action module reproduces the original."""

import json

import pytest
import torch

from models.convert import matrix_game
from models.convert.keymap import ConversionError
from models.matrix_game.action import MGActionModule
from tests.fixtures.golden import GOLDEN, load_golden


def _table(name: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v) for k, v in json.loads((GOLDEN / "original_keys.json").read_text())[name].items()}


@pytest.mark.parametrize("variant", ["universal", "gta_drive", "templerun"])
def test_published_variants_map_strictly(variant: str) -> None:
    table = _table(f"matrix_game_2_{variant}")
    assert matrix_game.check_shapes(table) == variant  # detected from the shapes, then checked
    ignored = [k for k in table if k.endswith("_norm.weight") and ".action_model." in k]
    assert len(ignored) == 15 * (4 if variant != "templerun" else 2)


def test_published_configs_match_upstream_files_via_the_fixture() -> None:
    # the fixture's tables come from the original config.json files; a wrong constant here breaks them
    for variant in ("universal", "gta_drive", "templerun"):
        table = _table(f"matrix_game_2_{variant}")
        cfg = matrix_game.PUBLISHED[variant]
        assert table["model.patch_embedding.weight"] == (cfg["dim"], cfg["in_dim"], 1, 2, 2)
        kb = cfg["action_config"]["keyboard_dim_in"]
        assert table["model.blocks.14.action_model.keyboard_embed.0.weight"] == (128, kb)
        assert "model.blocks.15.action_model.keyboard_embed.0.weight" not in table


def test_wrong_variant_config_is_rejected_with_the_keys() -> None:
    with pytest.raises(ConversionError, match=r"keyboard_embed\.0\.weight"):
        matrix_game.check_shapes(_table("matrix_game_2_gta_drive"), matrix_game.PUBLISHED["universal"])


@pytest.mark.parametrize("variant", ["universal", "templerun", "gta_drive"])
def test_converted_tiny_checkpoint_loads_the_action_module(variant: str) -> None:
    _w, meta = load_golden(f"matrix_game_{variant}_tiny")
    state, name, cfg = matrix_game.convert(GOLDEN / f"matrix_game_{variant}_tiny.safetensors", meta["config"])
    assert name == variant  # a config without "mode" (as published): the variant comes from the weights
    assert "condition_embedder.image_embedder.ff.net.0.proj.weight" in state
    module = MGActionModule(matrix_game.action_config(cfg))
    prefix = "blocks.0.action_model."
    module.load_state_dict(
        {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True
    )
    g, _rmeta = load_golden(f"matrix_game_{variant}_rollout")
    cache = module.new_cache()
    x = g["action0.in.c0.s0"]
    out = module(x, (3, 2, 3), 0, cache, g["keyboard"][:, :9], g["mouse"][:, :9] if "mouse" in g else None)
    assert (out - g["action0.out.c0.s0"]).abs().max() < 1e-4


class _ActionAdapter(torch.nn.Module):
    """Test harness only: puts the standalone MGActionModule (its own per-session cache) where
    CausalWanBlock calls its action module (after the cross-attention residual, before the FFN):
    an independent check of the converted weights and the placement. The served path (the
    module inside CausalWan, K/V in the pool) is tests/models/matrix_game/test_loader.py."""

    def __init__(self, module: MGActionModule) -> None:
        super().__init__()
        self.module = module
        self.cache = module.new_cache()
        self.grid: tuple[int, int, int] = (0, 0, 0)
        self.start = 0  # the chunk's first latent frame
        self.keyboard: torch.Tensor | None = None
        self.mouse: torch.Tensor | None = None

    def forward(self, x, _actions, _layer, _attn):
        return self.module(x, self.grid, self.start, self.cache, self.keyboard, self.mouse)


@pytest.mark.parametrize("variant", ["universal", "templerun", "gta_drive"])
def test_converted_golden_replays_the_original_rollout(variant: str) -> None:
    """Converted tiny checkpoint through our causal blocks + the image embedder + the action
    module: every x0 of the original 3-chunk rollout (window 6, eviction in chunk 3) within 1e-4."""
    from diffusers.models.transformers.transformer_wan import WanImageEmbedding

    from models.causal_wan import CausalWan, CausalWanConfig
    from models.sampler import FlowSchedule, add_noise
    from runtime.kv_cache import KVLayout

    _w, wmeta = load_golden(f"matrix_game_{variant}_tiny")
    orig = wmeta["config"]
    state, _, _ = matrix_game.convert(GOLDEN / f"matrix_game_{variant}_tiny.safetensors", orig)
    g, meta = load_golden(f"matrix_game_{variant}_rollout")
    roll = meta["rollout"]
    cfg = CausalWanConfig(
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=36,
        out_channels=16,
        freq_dim=32,
        ffn_dim=128,
        num_layers=2,
        chunk_frames=3,
        window_frames=orig["local_attn_size"],
        sink_frames=0,
    )
    model = CausalWan(cfg).eval()
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in state.items() if ".action_model." not in k and ".image_embedder." not in k},
        strict=False,
    )
    assert all(k.startswith("condition_embedder.text_embedder.") for k in missing) and not unexpected
    embed = WanImageEmbedding(1280, 64)
    pre = "condition_embedder.image_embedder."
    embed.load_state_dict({k[len(pre) :]: v for k, v in state.items() if k.startswith(pre)}, strict=True)
    action = MGActionModule(matrix_game.action_config(orig))
    pre = "blocks.0.action_model."
    action.load_state_dict({k[len(pre) :]: v for k, v in state.items() if k.startswith(pre)}, strict=True)
    adapter = _ActionAdapter(action)
    model.blocks[0].action = adapter

    sched = FlowSchedule(tuple(roll["denoising_step_list"]), roll["timestep_shift"])
    assert torch.allclose(torch.tensor(sched.timesteps), g["timesteps"], atol=1e-3)
    h, w = roll["latent_hw"]
    tpf, n, win = (h // 2) * (w // 2), roll["num_frame_per_block"], cfg.window_frames
    layout = KVLayout(0, win, tpf)
    with torch.no_grad():
        ctx = embed(g["visual_context"])[0]
        kv = [blk.text_kv(ctx) for blk in model.blocks]
        pool = model.setup_caches(1, h, w, text_tokens=ctx.shape[0])
        pool.set_text(0, [k for k, _ in kv], [v for _, v in kv])
        worst, out = 0.0, []
        for c in range(roll["chunks"]):
            start = c * n
            slots = layout.index([0], [start], n, pool.pad_row)
            raw = 1 + 4 * (start + n - 1)
            adapter.grid, adapter.start = (n, h // 2, w // 2), start
            adapter.keyboard = g["keyboard"][:, :raw]
            adapter.mouse = g["mouse"][:, :raw] if "mouse" in g else None
            cond = g["cond_concat"][:, :, start : start + n]
            dummy = torch.zeros(1, n, 1, 1)  # non-None so the block calls its action module
            x = g["noise"][:, :, start : start + n]
            for s, sigma in enumerate(sched.sigmas):
                t = torch.tensor([sched.timesteps[s]])
                flow = model.forward_chunk(torch.cat([x, cond], 1), t, slots, dummy)
                x0 = sched.to_x0(flow, x, sigma)
                worst = max(worst, (x0 - g[f"x0.c{c}.s{s}"]).abs().max().item())
                if s + 1 < len(sched.sigmas):
                    x = add_noise(x0, g[f"renoise.c{c}.s{s}"], sched.sigmas[s + 1])
            out.append(x0)
            ctx_in = torch.cat([x0, cond], 1)
            model.forward_chunk(ctx_in, torch.zeros(1), slots, dummy, need_output=False)
    final = (torch.cat(out, dim=2) - g["latents"]).abs().max().item()
    assert worst < 1e-4 and final < 1e-4, (worst, final)
