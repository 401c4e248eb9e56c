"""Add a learned creature head (`models.tiny_world.creature_head`) to a tiny-world model directory.

    python -m models.tiny_world.creatures --model DIR [--out DIR2] [--work SCRATCH] [--seed S] [--steps N]

trains a creature head for the model directory DIR (which needs a creature layer, a motion head
and a terrain prior) on the training worlds' episodes (the recipe's data, encoded with DIR's own
autoencoder) as the training run's `creatures` stage does (`Trainer.train_creatures`,
`TrainConfig.creature_steps`) and writes DIR (or a copy, DIR2) with DIR/creatures/ added: about
15 minutes on one CPU core, most of it encoding the episodes (`--work` keeps them for another
run). The labels are where the recorded creatures went (`models.tiny_world.training.creatures`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from models.tiny_world.add_head import HeadScript
from models.tiny_world.add_head import main as add_head
from models.tiny_world.plugin import save_creatures
from models.tiny_world.training.trainer import Trainer


def check(model: Path) -> None:
    """SystemExit unless `model` has a creature layer, a motion head and a terrain prior."""
    from models.registry import load_world

    world = load_world(model)
    ae = getattr(world.decoder, "ae", None)
    if ae is None or not ae.cfg.creatures:
        raise SystemExit(f"{model}: its autoencoder has no creature layer (MODEL_CARD.md: how to add one)")
    if getattr(world.plugin, "terrain", None) is None or getattr(world.plugin, "motion", None) is None:
        raise SystemExit(f"{model}: a creature head needs a model with a motion head and a terrain prior")


def add_creatures(trainer: Trainer, target: Path) -> None:
    """Train `trainer`'s creature head on its model's terrain prior and write it into `target`."""
    from models.registry import load_world

    trainer.terrain = load_world(target).plugin.terrain  # type: ignore[union-attr]
    trainer.train_creatures()
    assert trainer.creatures is not None
    save_creatures(trainer.creatures, target)


SCRIPT = HeadScript(
    "models.tiny_world.creatures", __doc__, "creature head", "creature_steps", add_creatures, check
)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    return add_head(SCRIPT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
