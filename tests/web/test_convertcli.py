"""`worldserve convert` end to end on the golden tiny checkpoints (web/convertcli.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import registry
from models.causal_wan import CausalWan, CausalWanConfig
from tests.fixtures.golden import GOLDEN, load_golden
from web.cli import main


def _config(tmp_path: Path, name: str) -> Path:
    _g, meta = load_golden(name)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(meta["config"]))
    return path


def convert_self_forcing(out: Path, config: Path | None = None) -> int:
    """`worldserve convert --from self-forcing` of the tiny golden checkpoint into `out`."""
    args = ["convert", "--from", "self-forcing", str(GOLDEN / "self_forcing_tiny.pt")]
    args += ["--config", str(config)] if config is not None else []
    return main([*args, "--out", str(out), "--no-progress"])


def test_self_forcing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sf"
    cfg = _config(tmp_path, "self_forcing_rollout")
    rc = convert_self_forcing(out, cfg)
    assert rc == 0
    meta = json.loads((out / "worldserve.json").read_text())
    assert meta["family"] == "self-forcing" and meta["requires"] == ["text_prompts", "vae"]
    assert meta["inference"]["denoising_step_list"] == [1000, 750, 500, 250]
    assert meta["inference"]["timestep_shift"] == 5.0 and meta["inference"]["num_frame_per_block"] == 3
    model = CausalWan(CausalWanConfig.from_dict(meta["transformer"]))
    model.load_state_dict(
        load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors")), strict=True
    )
    assert "serving it still needs: text_prompts, vae" in capsys.readouterr().out


def test_matrix_game_directory_without_vae_and_clip_is_refused_by_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mg"
    cfg = _config(tmp_path, "matrix_game_universal_rollout")
    src = GOLDEN / "matrix_game_universal_tiny.safetensors"
    assert (
        main(
            [
                "convert",
                "--from",
                "matrix-game-2",
                str(src),
                "--config",
                str(cfg),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    meta = json.loads((out / "worldserve.json").read_text())
    assert meta["requires"] == ["vae", "clip_vision"]  # the server runs the rest (tests/web/test_mg_serve.py)
    assert meta["original"]["local_attn_size"] == 6 and meta["inference"]["denoising_step_list"] == [
        1000,
        666,
        333,
    ]
    weights = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert "blocks.0.action_model.t_qkv.weight" in weights and "blocks.0.attn2.norm_q.weight" in weights
    with pytest.raises(registry.UnsupportedModelError, match="needs vae, clip_vision"):
        registry.load_world(out)
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--out", str(tmp_path / "x.mp4")]) == 2
    assert "cannot run yet" in capsys.readouterr().err and not (tmp_path / "x.mp4").exists()


def test_failure_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sf"
    rc = convert_self_forcing(out)
    assert rc == 2
    err = capsys.readouterr().err
    assert "mis-shaped" in err and "pass --config" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_and_names_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep").write_text("x")
    cfg = _config(tmp_path, "self_forcing_rollout")
    rc = convert_self_forcing(out, cfg)
    assert rc == 2 and "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep"]
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    assert (
        main(["convert", "--from", "matrix-game-2", str(junk), "--out", str(tmp_path / "o"), "--no-progress"])
        == 2
    )
    assert "junk.pt: not a safetensors file or torch checkpoint" in capsys.readouterr().err


def test_fastvideo_layout_gives_the_same_weights(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "matrix_game_universal_rollout")
    ref = tmp_path / "ref"
    main(
        [
            "convert",
            "--from",
            "matrix-game-2",
            str(GOLDEN / "matrix_game_universal_tiny.safetensors"),
            "--config",
            str(cfg),
            "--out",
            str(ref),
            "--no-progress",
        ]
    )
    want = load_file(str(ref / "transformer" / "diffusion_pytorch_model.safetensors"))
    # a FastVideo-style directory: diffusers names, patch_embedding.proj.*, the unused norms kept
    fv = tmp_path / "fv" / "transformer"
    fv.mkdir(parents=True)
    state = {
        ("patch_embedding.proj." + k[len("patch_embedding.") :] if k.startswith("patch_embedding.") else k): v
        for k, v in want.items()
    }
    state["blocks.0.action_model.img_attn_q_norm.weight"] = torch.ones(64)
    from safetensors.torch import save_file

    save_file(state, str(fv / "diffusion_pytorch_model.safetensors"))
    out = tmp_path / "conv"
    assert (
        main(
            [
                "convert",
                "--from",
                "fastvideo",
                str(fv.parent),
                "--config",
                str(cfg),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    got = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_self_forcing_directory_loads_with_a_vae_and_is_refused_without(tmp_path: Path) -> None:
    """With a VAE the Self-Forcing directory loads (text prompts are served now); without one it
    is refused, naming the VAE."""
    from safetensors.torch import save_file

    from models.convert import output, wan_vae

    g, vmeta = load_golden("wan_vae_tiny")
    vae_src = tmp_path / "vae.safetensors"
    save_file(
        {k: v for k, v in g.items() if k not in ("input", "encoded", "latent", "decoded")}, str(vae_src)
    )
    _g, meta = load_golden("self_forcing_rollout")
    bare = output.convert_sources("self-forcing", [GOLDEN / "self_forcing_tiny.pt"], meta["config"])
    with pytest.raises(registry.UnsupportedModelError, match="needs vae"):
        registry.load_world(output.write(bare, tmp_path / "bare", progress=False))
    conv = output.convert_sources("self-forcing", [GOLDEN / "self_forcing_tiny.pt"], meta["config"])
    conv.vae = wan_vae.convert(vae_src, vmeta["config"])
    conv.requires.remove("vae")
    conv.serving["decoder"] = {"kind": "wan"}
    out = output.write(conv, tmp_path / "sf", progress=False)
    world = registry.load_world(out)
    weights = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(world.transformer.state_dict()["proj_out.weight"], weights["proj_out.weight"])
    assert world.config.schedule.steps == (1000, 750, 500, 250) and world.transformer.cfg.sink_frames == 0
    assert world.config.text_prompts


def _convert_matrix_game(tmp_path: Path, **config: object) -> tuple[int, Path]:
    _g, meta = load_golden("matrix_game_universal_rollout")
    tmp_path.mkdir(exist_ok=True)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(meta["config"] | config))
    out = tmp_path / "mg"
    src = GOLDEN / "matrix_game_universal_tiny.safetensors"
    argv = ["convert", "--from", "matrix-game-2", str(src), "--config", str(cfg), "--out", str(out)]
    return main([*argv, "--no-progress"]), out


def test_matrix_game_frame_size_comes_from_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from models.matrix_game.loader import world_config

    rc, out = _convert_matrix_game(tmp_path, height=32, width=48)
    assert rc == 0 and "(universal, 48x32 frames)" in capsys.readouterr().out
    meta = json.loads((out / "worldserve.json").read_text())
    inf = meta["inference"]
    assert (inf["height"], inf["width"], inf["latent_hw"], inf["tokens_per_frame"]) == (32, 48, [4, 6], 6)
    assert (world_config(meta).height, world_config(meta).width) == (32, 48)  # what a server would serve
    rc, out = _convert_matrix_game(tmp_path / "published")
    assert rc == 0 and "(universal, 640x352 frames)" in capsys.readouterr().out


@pytest.mark.parametrize(("field", "value"), [("height", 30), ("width", 0), ("width", "48")])
def test_matrix_game_refuses_a_frame_size_it_cannot_serve(
    field: str, value: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _convert_matrix_game(tmp_path, **{field: value})
    err = capsys.readouterr().err
    assert rc == 2 and f"--config {field} {value!r}: a frame side must be a positive multiple of 16" in err
    assert len(err.strip().split("\n")) == 1 and not out.exists()
