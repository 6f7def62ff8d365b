"""The slot transition table: shape of the machine and refusal of everything else."""

from __future__ import annotations

import itertools

import pytest

from shmserve.slotstate import TRANSITIONS, Actor, IllegalTransition, SlotState, check_transition, state_name


def reachable(start: SlotState) -> set[SlotState]:
    seen, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for frm, to in TRANSITIONS:
            if frm == here and to not in seen:
                seen.add(to)
                todo.append(to)
    return seen


def test_every_state_is_reachable_and_returns_to_free():
    assert reachable(SlotState.FREE) == set(SlotState)
    for state in SlotState:
        assert SlotState.FREE in reachable(state)


def test_the_happy_path_is_allowed_for_the_right_actors():
    path = [(SlotState.FREE, SlotState.WRITING, Actor.FRONTEND), (SlotState.WRITING, SlotState.READY, Actor.FRONTEND),
            (SlotState.READY, SlotState.RUNNING, Actor.WORKER), (SlotState.RUNNING, SlotState.DONE, Actor.WORKER),
            (SlotState.DONE, SlotState.FREE, Actor.FRONTEND)]
    for frm, to, actor in path:
        check_transition(frm, to, actor)


@pytest.mark.parametrize("frm,to", list(itertools.product(SlotState, SlotState)))
def test_edges_outside_the_table_raise(frm, to):
    for actor in Actor:
        if actor in TRANSITIONS.get((frm, to), ()):
            check_transition(frm, to, actor)
        else:
            with pytest.raises(IllegalTransition):
                check_transition(frm, to, actor)


def test_workers_never_free_or_acquire_and_never_leave_done():
    for (frm, to), actors in TRANSITIONS.items():
        if Actor.WORKER in actors:
            assert frm in (SlotState.READY, SlotState.RUNNING)
            assert to in (SlotState.RUNNING, SlotState.DONE, SlotState.ERROR)


def test_unknown_states():
    with pytest.raises(IllegalTransition, match="unknown"):
        check_transition(9, 0, Actor.FRONTEND)
    assert state_name(2) == "READY" and state_name(99) == "INVALID(99)"


def test_a_lane_client_takes_only_the_front_ends_edges_outside_the_worker():
    """The client of a lane plays the front-end's part on its own slots — taking back a call no
    worker has claimed (READY -> ERROR, issue 29's cancellation) included —, except failing a
    request the worker holds: that is the front-end's, and only once the worker is dead."""
    for (frm, to), actors in TRANSITIONS.items():
        if Actor.CLIENT in actors:
            assert Actor.FRONTEND in actors and Actor.WORKER not in actors
            assert (frm, to) != (SlotState.RUNNING, SlotState.ERROR)
    check_transition(SlotState.READY, SlotState.ERROR, Actor.CLIENT)
    for frm, to in ((SlotState.READY, SlotState.RUNNING), (SlotState.RUNNING, SlotState.DONE),
                    (SlotState.RUNNING, SlotState.ERROR)):
        with pytest.raises(IllegalTransition, match="client"):
            check_transition(frm, to, Actor.CLIENT)
