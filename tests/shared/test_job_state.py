import pytest

from shared.job_state import TERMINAL, TRANSITIONS, JobStatus, can_transition, sources_of
from shared.lua import PRELUDE


def test_happy_path_and_terminal_states() -> None:
    assert can_transition(JobStatus.QUEUED, JobStatus.RUNNING)
    assert can_transition(JobStatus.RUNNING, JobStatus.SUCCEEDED)
    for status in TERMINAL:
        assert status.is_terminal
        assert TRANSITIONS[status] == frozenset()
    assert not JobStatus.RUNNING.is_terminal


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (JobStatus.QUEUED, JobStatus.SUCCEEDED),  # never finished without running
        (JobStatus.RUNNING, JobStatus.EXPIRED),  # a started job does not expire
        (JobStatus.SUCCEEDED, JobStatus.CANCELLED),
        (JobStatus.CANCELLED, JobStatus.RUNNING),
    ],
)
def test_illegal_transitions(current: JobStatus, new: JobStatus) -> None:
    assert not can_transition(current, new)


def test_lua_checks_the_same_table() -> None:
    assert sources_of(JobStatus.EXPIRED) == [JobStatus.QUEUED]
    assert "local EXPIRED_FROM = {['queued']=true}" in PRELUDE
    assert "local SUCCEEDED_FROM = {['running']=true}" in PRELUDE
