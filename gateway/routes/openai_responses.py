"""/v1/responses: OpenAI's Responses API, a response being a job on the queue (gateway/openai_responses.py):
create (whole, `stream: true`, or `background: true`), read, cancel, delete, and list its input items."""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request, Response
from pydantic import BaseModel

from gateway.deps import ApiKeyDep, GatewayDep, SubmitCallerDep
from gateway.errors import ApiError
from gateway.openai_api import JOB_ID_HEADER, ChunkStream
from gateway.openai_errors import OPENAI_ERRORS, OpenAIRoute
from gateway.openai_responses import ResponseCall, history_of, load
from shared import openai_response_object as ro
from shared.job_state import ErrorCode, JobStatus
from shared.openai_responses import RESPONSE_ID_PATTERN, ResponseRequest, job_id_of

router = APIRouter(prefix="/v1/responses", tags=["openai"], route_class=OpenAIRoute, responses=OPENAI_ERRORS)
ResponseId = Annotated[str, Path(pattern=RESPONSE_ID_PATTERN)]

EVENTS_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "with stream: true, the response's events"}
}


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


@router.post("", response_model=ro.Response, responses=EVENTS_RESPONSE)
async def create_response(
    body: ResponseRequest,
    request: Request,
    gw: GatewayDep,
    key: ApiKeyDep,
    caller: SubmitCallerDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=256)] = None,
) -> Response:
    """Answer an input (a conversation's next turn with `previous_response_id`). The job behind the response is
    named in the `x-specfleet-job-id` header; the response's id is `resp_<job id>`."""
    history = await history_of(gw, request, key, body)
    return await ResponseCall(gw, request, body, history).respond(caller, idempotency_key)


@router.get("/{response_id}", response_model=ro.Response, responses=EVENTS_RESPONSE)
async def get_response(
    response_id: ResponseId,
    request: Request,
    gw: GatewayDep,
    key: ApiKeyDep,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
) -> Response | ro.Response:
    """A stored response, as it stands (queued, in progress, or its output); with `stream=true` its events from
    the first (as the stream that made it; `starting_after`: those after that sequence number), to its end."""
    stored = await load(gw, request, key, response_id)
    model = await gw.served_model.check(None)
    if stream:
        events = ResponseCall.replay(gw, request, stored, model, -1 if starting_after is None else starting_after)
        return ChunkStream(events, {JOB_ID_HEADER: stored.job.id})
    if starting_after is not None:
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "starting_after needs stream=true", field="starting_after")
    return ro.response_of(stored.job, stored.body, model, gw.settings.reasoning_parser)


@router.post("/{response_id}/cancel", response_model=ro.Response)
async def cancel_response(response_id: ResponseId, request: Request, gw: GatewayDep, key: ApiKeyDep) -> ro.Response:
    """Cancel a background response that has not ended (a cancelled one answers as it is)."""
    stored = await load(gw, request, key, response_id)
    if not stored.body.background:
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "only a response created with background: true can be cancelled",
                       field="response_id")  # fmt: skip
    if stored.job.status.is_terminal and stored.job.status is not JobStatus.CANCELLED:
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"the response has ended ({stored.job.status.value}); "
                       "only a queued or in-progress response can be cancelled", field="response_id")  # fmt: skip
    await gw.store.cancel(job_id_of(response_id))
    stored = await load(gw, request, key, response_id)
    return ro.response_of(stored.job, stored.body, await gw.served_model.check(None), gw.settings.reasoning_parser)


@router.delete("/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: ResponseId, request: Request, gw: GatewayDep, key: ApiKeyDep) -> DeletedResponse:
    """Forget a stored response (a response not yet ended is cancelled first: nobody could read it)."""
    stored = await load(gw, request, key, response_id)
    if not stored.job.status.is_terminal:
        await gw.store.cancel(job_id_of(response_id))
    await gw.store.drop_response(job_id_of(response_id))
    return DeletedResponse(id=response_id)


@router.get("/{response_id}/input_items", response_model=InputItemList)
async def list_input_items(
    response_id: ResponseId,
    request: Request,
    gw: GatewayDep,
    key: ApiKeyDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> InputItemList:
    """The items the response was given (its own input: a previous response's are that one's), newest first
    unless `order=asc`; `after` = the last id of the previous page."""
    stored = await load(gw, request, key, response_id)
    items = stored.record.input if order == "asc" else stored.record.input[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, ErrorCode.INVALID_REQUEST, f"after: no item {after} in this response's input", field="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None, last_id=page[-1]["id"] if page else None,
                         has_more=len(items) > limit)  # fmt: skip
