"""POST /v1/completions: OpenAI's text completion, served by a job on the queue (sync, or `stream: true`)."""

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from pydantic import BaseModel

from gateway.deps import GatewayDep, SubmitCallerDep
from gateway.openai_api import Call
from gateway.openai_errors import OPENAI_ERRORS, OpenAIRoute
from shared.openai_compat import Completion, CompletionRequest

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute, responses=OPENAI_ERRORS)

STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "with stream: true, chunks then [DONE]"}
}


@router.post("/completions", response_model=Completion, responses=STREAM_RESPONSE)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    gw: GatewayDep,
    caller: SubmitCallerDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=256)] = None,
) -> Response | BaseModel:
    """Complete a prompt. The job behind the call is named in the `x-specfleet-job-id` header."""
    return await Call(gw, request, body, is_chat=False).run(caller, idempotency_key)
