"""Matrix-Game 2.0: its action module, CLIP image tower, image conditioning and directory loader."""
