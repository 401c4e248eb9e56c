"""Prompt text -> UMT5 token ids: the cleanup Wan applies, then the tokenizer's own tokenizer.json.

Wan cleans a prompt before tokenizing it (`clean='whitespace'`): ftfy's `fix_text`, HTML entities
unescaped twice, whitespace runs collapsed to one space, the ends stripped. `clean_prompt` does the
parts of ftfy that change ordinary typed or pasted text, written here rather than depending on
ftfy:

* HTML entities unescaped (once more before the rest, as ftfy does when the text has no "<"),
* curly quotes and apostrophes -> ASCII (the tokenizer's own normalisation keeps them, so
  "it’s" and "it's" would tokenize differently),
* Latin ligatures (ﬁ) and full-width ASCII (ＡＢＣ, the ideographic space) -> plain letters,
* terminal escape sequences and control characters removed, line breaks as spaces,
* NFC normalisation.

Not done: ftfy's mojibake repair (text decoded with the wrong codec, "cafÃ©" -> "café"). Such a
prompt tokenizes as typed, which the original would have repaired first.

Length: the original pads or truncates to 512 tokens (its end-of-sequence token included) and
silently drops the rest of a longer prompt. Here a prompt over the limit is refused
(`PromptTooLong`, answered `invalid_field` by the server) so a client never gets a world for
text it did not send.
"""

from __future__ import annotations

import html
import re
import unicodedata
from pathlib import Path

SINGLE_QUOTES = re.compile("[\u02bc\u2018\u2019\u201a\u201b]")
DOUBLE_QUOTES = re.compile("[\u201c\u201d\u201e\u201f]")
LIGATURES = re.compile("[\u0132\u0133\ufb00-\ufb06]")
FULL_WIDTH = re.compile("[\u3000\uff01-\uff5e]")
TERMINAL_ESCAPES = re.compile("\x1b\\[[0-9;]*[A-Za-z]")
CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f\u206a-\u206f\ufeff\ufff9-\ufffc]")
WHITESPACE = re.compile(r"\s+")


def clean_prompt(text: str) -> str:
    """A prompt as Wan's text encoder sees it (the module docstring lists what is and is not done)."""
    text = TERMINAL_ESCAPES.sub("", text)
    if "<" not in text:  # ftfy unescapes HTML first unless the text may be markup
        text = html.unescape(text)
    text = CONTROL.sub("", text)
    text = SINGLE_QUOTES.sub("'", text)
    text = DOUBLE_QUOTES.sub('"', text)
    text = LIGATURES.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text)
    text = FULL_WIDTH.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text)
    text = unicodedata.normalize("NFC", text)
    text = html.unescape(html.unescape(text)).strip()
    return WHITESPACE.sub(" ", text).strip()


class PromptTooLong(ValueError):
    """The prompt takes more tokens than the encoder (or the world) accepts."""


class PromptTokenizer:
    """A `tokenizers` tokenizer from a local tokenizer.json, ending each prompt with its EOS."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # an optional extra: only text worlds with an encoder need it
            raise ImportError(
                "a text encoder needs the `tokenizers` package: pip install 'worldserve[text]'"
            ) from exc
        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(self.path))
        self._tok.no_padding()
        self._tok.no_truncation()

    def ids(self, prompt: str) -> list[int]:
        """Token ids of the cleaned prompt, special tokens (the EOS) included, never truncated."""
        return self._tok.encode(clean_prompt(prompt), add_special_tokens=True).ids

    def checked_ids(self, prompt: str, limit: int) -> list[int]:
        """`ids`, or PromptTooLong when they are more than `limit`."""
        ids = self.ids(prompt)
        if len(ids) > limit:
            raise PromptTooLong(
                f"prompt is {len(ids)} tokens, this model takes at most {limit} "
                "(its end-of-sequence token included); shorten it"
            )
        return ids
