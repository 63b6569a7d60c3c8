"""The ids an API instance holds as pending (api/commands.py `SubmittedCommands`): pure logic."""

from __future__ import annotations

from esk.api.commands import SubmittedCommands


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_id_is_held_until_discarded_or_its_hold_is_over() -> None:
    clock = Clock()
    held = SubmittedCommands(clock)
    held.add("a")
    clock.now = SubmittedCommands.HOLD_S / 2
    held.add("b")
    assert "a" in held and "b" in held
    held.discard("b")
    held.discard("never-held")
    assert "b" not in held
    clock.now = SubmittedCommands.HOLD_S + 1
    assert "a" not in held and len(held) == 0


def test_an_id_submitted_again_is_held_from_then() -> None:
    clock = Clock()
    held = SubmittedCommands(clock)
    held.add("a")
    held.add("b")
    clock.now = SubmittedCommands.HOLD_S - 1
    held.add("a")  # a retry under the same key
    clock.now = SubmittedCommands.HOLD_S + 1
    assert "a" in held and "b" not in held


def test_the_oldest_ids_are_let_go_past_the_most_held() -> None:
    held = SubmittedCommands(Clock())
    held.MAX_HELD = 3
    for n in range(5):
        held.add(str(n))
    assert len(held) == 3
    assert [str(n) in held for n in range(5)] == [False, False, True, True, True]
