"""A job's request -> the engine's prompt: text, or token ids (given, or a resumed job's prompt + output)."""

from shared.schemas import JobRequest
from workers.worker.prompts import engine_prompt


def test_token_ids_go_as_they_are_and_a_resumed_job_appends_its_output() -> None:
    request = JobRequest(prompt_token_ids=[5, 6, 7], max_tokens=4)
    assert engine_prompt(request, None, []) == [5, 6, 7]  # no tokenizer: token ids need none
    assert engine_prompt(request, None, [9, 10]) == [5, 6, 7, 9, 10]
