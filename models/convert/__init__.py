"""Converters from the checkpoints the field publishes to the layouts our modules load.

Each converter is an explicit key map (original name -> our name) checked in full before any
tensor is copied: every source key must be mapped or deliberately ignored, every target key must
be produced, and every shape must match, or `ConversionError` lists all the problems at once.

* `self_forcing`: Self-Forcing's `self_forcing_dmd.pt` (original Wan names under `model.`) ->
  diffusers `WanTransformer3DModel` names (what `models.causal_wan.CausalWan` loads).
* `matrix_game`: Matrix-Game 2.0 `*_distill.safetensors` -> diffusers Wan I2V names plus the
  action modules under `blocks.N.action_model.*` (loaded by `models.matrix_game.action.MGActionModule`).
* `fastvideo`: FastVideo's "-Diffusers" repositories (already diffusers names) -> the same targets.
* `wan_vae`: `Wan2.1_VAE.pth` -> diffusers `AutoencoderKLWan`.
* `clip`: the visual tower of `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` ->
  `models.matrix_game.clip_vision.CLIPVision`.
* `output`: writes a converted model directory (atomically) and its config.
"""
