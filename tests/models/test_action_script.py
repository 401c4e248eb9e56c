"""Action scripts (models/action_script.py): any world's key names, checked where keys are given."""

import pytest

from models.action_script import parse_action_script


def test_a_script_reads_any_worlds_key_names():
    assert parse_action_script("") == []
    assert parse_action_script("up*2, ,left+fire") == [
        frozenset({"up"}),
        frozenset({"up"}),
        frozenset(),
        frozenset({"left", "fire"}),
    ]
    assert parse_action_script("*3") == [frozenset()] * 3


def test_keys_given_are_checked_by_name():
    assert parse_action_script("d*2", keys=("w", "a", "s", "d")) == [frozenset({"d"})] * 2
    with pytest.raises(ValueError, match=r"item 1 \('up'\): unknown key\(s\) \['up'\]; valid keys"):
        parse_action_script("d,up", keys=("w", "a", "s", "d"))
    with pytest.raises(ValueError, match="'\\*' must be followed by a count"):
        parse_action_script("d*x")
    with pytest.raises(ValueError, match="unknown key"):
        parse_action_script("w++d")  # an empty name between two '+'
