"""UMT5, Wan's text encoder: the model (`model.py`), prompt cleanup and tokenizer
(`tokenizer.py`), loading from a local Wan or diffusers directory (`load.py`)."""
