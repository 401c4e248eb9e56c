"""The tiny world's trainer, one module a stage (`python -m models.tiny_world.train` runs them)."""
