"""The model families this build serves, as module names (no imports here).

`models.registry` imports each module listed the first time it looks a name, family, start-image
kind or part up; importing a family's module registers it (`models.registry.register`). Keeping
the list as strings keeps the registry free of any import edge to a family.
"""

FAMILIES: tuple[str, ...] = (
    "models.tiny_world.loader",  # `tiny-world`, the default world
    "models.matrix_game.loader",  # converted Matrix-Game 2.0 directories ("family": "matrix-game-2")
)
