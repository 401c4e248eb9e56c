"""World names the command line needs before any model code loads (no torch here).

`worldserve --help` shows the default world; importing models.registry for it would load torch
and diffusers first (seconds), so the name lives here and the registry re-exports it.
"""

DEFAULT_MODEL = "tiny-world"  # the world `serve` and `generate` load without --model
