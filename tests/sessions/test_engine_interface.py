"""Sessions and the web layer talk to the engine thread through `EngineThread`'s own methods:
no reach-through to the `Engine` behind it, no writes to another object's private fields."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "sessions").glob("*.py"), *(ROOT / "web").glob("*.py")])
REACH_THROUGH = re.compile(r"\.engine\.engine\b|\b(?:et|_et|engine_thread)\.engine\b")
FOREIGN_PRIVATE_WRITE = re.compile(r"^\s*(?!self\b)[a-z_]\w*\._[a-z]\w*\s*=[^=]", re.MULTILINE)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reach_through_to_the_engine(path: Path) -> None:
    text = path.read_text()
    assert not REACH_THROUGH.findall(text)
    assert not FOREIGN_PRIVATE_WRITE.findall(text)


def test_the_patterns_catch_what_they_are_for() -> None:
    assert REACH_THROUGH.search("rid = self._et.engine.new_request_id()")
    assert REACH_THROUGH.search("self.engine.engine.worlds[m]")
    assert FOREIGN_PRIVATE_WRITE.search("        dst._chunk_base = src._chunk_base\n")
    assert not FOREIGN_PRIVATE_WRITE.search("        self._chunk_base = src._chunk_base\n")
