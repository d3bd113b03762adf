import pytest
from pydantic import ValidationError

from shared.job_record import job_from_fields
from shared.job_state import JobStatus
from shared.schemas import JobRequest, Priority


def test_prompt_or_messages_exactly_one() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        JobRequest.model_validate({})
    with pytest.raises(ValidationError, match="exactly one"):
        JobRequest.model_validate({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert JobRequest.model_validate({"messages": [{"role": "user", "content": "b"}]}).prompt is None


def test_defaults_and_speculative_mapping() -> None:
    request = JobRequest(prompt="x")
    assert request.priority is Priority.DEFAULT
    assert request.speculative_method is None
    assert JobRequest(prompt="x", speculative=False).speculative_method == "none"
    assert JobRequest(prompt="x", speculative="ngram").speculative_method == "ngram"
    assert JobRequest.model_validate({"prompt": "x", "speculative": "eagle"}).speculative_method == "eagle"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "priority": "urgent"},
        {"prompt": "x", "unknown": 1},
        {"prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
        {"prompt": "x", "ttl_s": -1},
        {"prompt": "x", "stream_interval_ms": 0.5},
        {"prompt": "x", "stream_interval_ms": 60_001},
    ],
)
def test_invalid_requests(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        JobRequest.model_validate(body)


def test_job_from_hash_running_with_partial_output() -> None:
    job = job_from_fields(
        {
            "id": "abc",
            "status": "running",
            "priority": "batch",
            "created_at": "1.5",
            "started_at": "2.0",
            "text": "hello wor",
            "token_ids": "5,6,7",
            "completion_tokens": "3",
            "prompt_tokens": "4",
            "metadata": '{"k": "v"}',
        },
        "http://h:1/",
    )
    assert job.status is JobStatus.RUNNING
    assert job.output is not None and job.output.token_ids == [5, 6, 7] and job.output.finish_reason is None
    assert job.usage.prompt_tokens == 4 and job.usage.completion_tokens == 3
    assert job.urls.stream == "http://h:1/v1/jobs/abc/stream"
    assert job.metadata == {"k": "v"}
