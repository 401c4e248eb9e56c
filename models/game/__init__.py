"""The built-in game: ground-truth simulator, action scripts and training policy.

``simulator`` renders the world (numpy only, no torch); ``actions`` defines the key space, the
action-script syntax and the persistent random policy; ``python -m models.game`` writes frames
for a seed and an action script so anyone can compare a model against the simulator.
"""

from models.game.actions import (
    KEYS,
    encode_actions,
    format_action_script,
    parse_action_script,
    random_policy,
)
from models.game.simulator import (
    FPS,
    Game,
    GameConfig,
    GameError,
    Palette,
    SimResult,
    Tile,
    World,
    generate_world,
    held_moves,
    simulate,
)

__all__ = [
    "FPS",
    "KEYS",
    "Game",
    "GameConfig",
    "GameError",
    "Palette",
    "SimResult",
    "Tile",
    "World",
    "encode_actions",
    "format_action_script",
    "generate_world",
    "held_moves",
    "parse_action_script",
    "random_policy",
    "simulate",
]
