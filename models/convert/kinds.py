"""The checkpoint families `worldserve convert --from` accepts (no torch here: the CLI lists them
in its help before any converter loads)."""

KINDS = ("self-forcing", "longlive", "matrix-game-2", "fastvideo")
