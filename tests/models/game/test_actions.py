"""Tests for models/game/actions.py: key checks, multi-hot, action scripts, random policy."""

import itertools

import numpy as np
import pytest

from models.game import KEYS, encode_actions, format_action_script, parse_action_script, random_policy

W, A, S, D, SPACE = (frozenset({k}) for k in KEYS)
IDLE: frozenset[str] = frozenset()


def test_parse_action_script() -> None:
    assert parse_action_script("") == []
    assert parse_action_script("d*2,a,,space") == [D, D, A, IDLE, SPACE]
    assert parse_action_script(" w + d * 2 , *3 ") == [W | D, W | D, IDLE, IDLE, IDLE]
    assert parse_action_script("d*0,s") == [S]
    assert parse_action_script(",") == [IDLE, IDLE]


@pytest.mark.parametrize("script", ["x", "d*", "d*-1", "d*2*3", "w+", "d*two"])
def test_parse_action_script_rejects_bad_items(script: str) -> None:
    with pytest.raises(ValueError, match="item 0"):
        parse_action_script(script)


def test_format_action_script_round_trips() -> None:
    actions = [D, D, D, W | D | SPACE, IDLE, IDLE, A]
    script = format_action_script(actions)
    assert script == "d*3,w+d+space,*2,a"
    assert parse_action_script(script) == actions
    policy = random_policy(5, 300)
    assert parse_action_script(format_action_script(policy)) == policy
    assert format_action_script([]) == ""


def test_encode_actions_is_multi_hot_in_key_order() -> None:
    out = encode_actions([IDLE, W | D, SPACE, "space"])
    expected = np.array([[0, 0, 0, 0, 0], [1, 0, 0, 1, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 1]], np.float32)
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="unknown key"):
        encode_actions([{"q"}])


def test_random_policy_is_deterministic() -> None:
    assert random_policy(3, 500) == random_policy(3, 500)
    assert random_policy(3, 500) != random_policy(4, 500)
    assert random_policy(3, 100) == random_policy(3, 500)[:100]
    assert len(random_policy(3, 37)) == 37


def test_random_policy_holds_keys_and_is_varied() -> None:
    actions = random_policy(0, 4000)
    moves = [a - {"space"} for a in actions]
    assert IDLE in moves and {W, A, S, D} <= set(moves)
    assert any(len(m) == 2 for m in moves)
    assert 0.01 < np.mean(["space" in a for a in actions]) < 0.2
    # Movement keys are held for runs of at least 4 frames (the last run may be cut short).
    runs = [len(list(run)) for _, run in itertools.groupby(moves)][:-1]
    assert min(runs) >= 4
    assert 8 < np.mean(runs) < 30
