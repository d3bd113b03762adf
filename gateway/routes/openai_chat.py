"""POST /v1/chat/completions: OpenAI's chat completion, served by a job on the queue (sync, or `stream: true`).
The worker renders the messages with the model tokenizer's chat template (workers/worker/prompts.py)."""

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from pydantic import BaseModel

from gateway.deps import GatewayDep, SubmitCallerDep
from gateway.openai_api import Call
from gateway.openai_errors import OPENAI_ERRORS, OpenAIRoute
from gateway.routes.openai_completions import STREAM_RESPONSE
from shared.openai_compat import ChatCompletion, ChatCompletionRequest

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute, responses=OPENAI_ERRORS)


@router.post("/chat/completions", response_model=ChatCompletion, responses=STREAM_RESPONSE)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    gw: GatewayDep,
    caller: SubmitCallerDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=256)] = None,
) -> Response | BaseModel:
    """Answer a conversation. The job behind the call is named in the `x-specfleet-job-id` header."""
    return await Call(gw, request, body, is_chat=True).run(caller, idempotency_key)
