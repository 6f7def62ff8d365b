"""A request's life in the front-end (``shmserve.frontend.requests``): the shape of its table, the
refusal of every other event, and that no sequence of events answers a request twice."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shmserve.frontend.requests import (HOLDING, TRANSITIONS, UNANSWERED, Event, IllegalTransition, Request,
                                        RequestState, next_state)

from helpers.fake_frontend import reachable

S, E = RequestState, Event
ANSWERING = {E.HOLD, E.ABANDON, E.END}  # the events on which a request gets its one answer


def reachable_from(start: RequestState) -> set[RequestState]:
    return reachable(start, ((frm, to) for (frm, _), to in TRANSITIONS.items()))


def new_request() -> Request:
    return Request(door=None, id=1, model=None, inputs=(), timeout_s=1.0)


def test_every_state_is_reachable_from_new_and_done_from_every_state():
    """No dead state, and no state a request can be stuck in: DONE is always reachable."""
    assert reachable_from(S.NEW) == set(S)
    for state in S:
        assert S.DONE in reachable_from(state), state


def test_done_is_terminal():
    """Nothing leaves DONE: a finished request is never reused."""
    assert not [edge for edge in TRANSITIONS if edge[0] is S.DONE]


def test_answering_edges_leave_an_unanswered_state_for_an_answered_one():
    """HOLD, ABANDON and END are taken only from NEW, WAITING, ADMITTED or QUEUED and lead out of
    them; every other edge keeps a request on its side of the line, so no answer is ever undone."""
    for (frm, event), to in TRANSITIONS.items():
        if event in ANSWERING:
            assert frm in UNANSWERED and to not in UNANSWERED, (frm, event, to)
        else:
            assert (frm in UNANSWERED) == (to in UNANSWERED), (frm, event, to)


def test_a_slot_is_taken_only_on_admit_and_given_back_only_on_the_way_to_done():
    """HOLDING agrees with the table: only ADMIT takes a slot, and a request gives it back only
    on its way to DONE."""
    for (frm, event), to in TRANSITIONS.items():
        if frm not in HOLDING and to in HOLDING:
            assert event is E.ADMIT, (frm, event, to)
        if frm in HOLDING and to not in HOLDING:
            assert to is S.DONE, (frm, event, to)


def test_the_happy_paths():
    """An inline request answered with views, and a waited-for request answered without: both legal."""
    inline = [(S.NEW, E.ADMIT), (S.ADMITTED, E.PUBLISH), (S.QUEUED, E.HOLD), (S.FLUSHING, E.RELEASE)]
    waited = [(S.NEW, E.WAIT), (S.WAITING, E.ADMIT), (S.ADMITTED, E.PUBLISH), (S.QUEUED, E.END)]
    for path in (inline, waited):
        req = new_request()
        for state, event in path:
            assert req.state is state
            req.advance(event)
        assert req.state is S.DONE and req.answered


@pytest.mark.parametrize("state,event", list(itertools.product(S, E)))
def test_events_outside_the_table_raise_and_change_nothing(state, event):
    """Every (state, event) pair: the table's edge, or IllegalTransition with the state unchanged."""
    req = new_request()
    req.state = state
    if (state, event) in TRANSITIONS:
        assert req.advance(event) is TRANSITIONS[(state, event)] is next_state(state, event)
    else:
        with pytest.raises(IllegalTransition, match=f"{event.name} is not allowed in state {state.name}"):
            req.advance(event)
        assert req.state is state


class OneAnswer(RuleBasedStateMachine):
    """Throw any event at a request, in any order: the table accepts some and refuses the rest, and
    the request is answered at most once, exactly when it leaves the unanswered states."""

    def __init__(self):
        super().__init__()
        self.req = new_request()
        self.answers = 0

    @rule(event=st.sampled_from(list(E)))
    def take(self, event):
        before = self.req.state
        try:
            after = self.req.advance(event)
        except IllegalTransition:
            assert self.req.state is before
            return
        if before in UNANSWERED and after not in UNANSWERED:
            self.answers += 1
        assert event in ANSWERING or self.answers == (0 if after in UNANSWERED else 1)

    @rule(data=st.data())
    def take_an_allowed_event(self, data):
        allowed = [event for (frm, event) in TRANSITIONS if frm is self.req.state]
        if allowed:
            self.take(data.draw(st.sampled_from(allowed)))

    @invariant()
    def answered_at_most_once(self):
        assert self.answers == (0 if self.req.state in UNANSWERED else 1)
        assert self.req.answered == (self.answers == 1)


OneAnswer.TestCase.settings = settings(max_examples=60, stateful_step_count=20, derandomize=True, database=None,
                                       deadline=None)
test_no_sequence_of_events_answers_a_request_twice = OneAnswer.TestCase
