"""/v1/batches: submit a JSONL file (OpenAI Batch lines), read, list, results (JSONL), cancel.

Two ways in, one implementation: the file itself (a raw JSONL body or a multipart upload), or OpenAI's JSON body
`{"input_file_id", "endpoint", "completion_window", "metadata"}` naming a file uploaded to /v1/files (the key's
own), whose lines must all call `endpoint`. Either way the lines are validated the same way (every bad line
named, 422) and queued by the same store call.
"""

import asyncio
import json
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from gateway.auth import may_access
from gateway.batch_store import BatchStore
from gateway.cancel_after import parse_duration_s
from gateway.deps import ApiKeyDep, GatewayDep
from gateway.errors import ERROR_RESPONSES, ApiError
from gateway.file_store import FileStore
from gateway.idempotency import Idempotency, IdempotencyConflict, made_by
from gateway.webhook_guard import check_webhook
from shared import keys
from shared.api_keys import ApiKey
from shared.batch_format import BatchLine, BatchLineError, BatchTooLarge, parse_batch
from shared.batch_schemas import (
    Batch,
    BatchErrorInfo,
    BatchErrorResponse,
    BatchList,
    BatchOptions,
    FileBatchRequest,
    batch_from_fields,
)
from shared.batch_state import BatchStatus
from shared.job_state import ErrorCode
from shared.schemas import first_error
from shared.settings import ServiceSettings

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=ERROR_RESPONSES)

BatchId = Annotated[str, Path(pattern=r"^batch_[A-Za-z0-9]{1,64}$")]
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # form fields and boundaries around the file


async def _store(gw: GatewayDep) -> BatchStore:
    return BatchStore(gw.redis)


StoreDep = Annotated[BatchStore, Depends(_store)]


def _too_large(message: str) -> ApiError:
    return ApiError(413, ErrorCode.INVALID_REQUEST, message, field="file")


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(f"the batch file is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _options(webhook: str | None, metadata: str | None, window_s: str | float | None) -> BatchOptions:
    """The options as given (query parameters or form fields): 422 naming the one that is wrong."""
    try:
        parsed_metadata = json.loads(metadata) if metadata else {}
    except ValueError as exc:
        raise ApiError(422, ErrorCode.INVALID_REQUEST, f"metadata: not valid JSON ({exc})", field="metadata") from exc
    try:
        return BatchOptions(
            webhook=webhook or None,
            metadata=parsed_metadata,
            completion_window_s=window_s if window_s not in (None, "") else None,  # type: ignore[arg-type]
        )
    except ValidationError as exc:
        loc, reason = first_error(exc.errors())
        field_name = ".".join(str(part) for part in loc) or "metadata"
        raise ApiError(422, ErrorCode.INVALID_REQUEST, f"{field_name}: {reason}", field=field_name) from exc


@dataclass
class BatchInput:
    """What a batch is made of, whichever way it came in."""

    data: bytes  # the JSONL file
    options: BatchOptions
    endpoint: str | None = None  # the file form: every line must call it
    fields: dict[str, str] = field(default_factory=dict)  # extra batch hash fields (input_file_id, endpoint, window)


async def _input(request: Request, gw: GatewayDep, key: ApiKey) -> BatchInput:
    """The file and options: multipart (`file`, `webhook`, `metadata`, `completion_window_s` fields), a
    raw JSONL body with the options as query parameters, or OpenAI's JSON body naming an uploaded file."""
    settings = gw.settings
    max_bytes = settings.batch_max_bytes
    declared = request.headers.get("content-length")
    is_multipart = request.headers.get("content-type", "").startswith("multipart/form-data")
    if (
        declared
        and declared.isdigit()
        and int(declared) > max_bytes + (MULTIPART_OVERHEAD_BYTES if is_multipart else 0)
    ):
        raise _too_large(f"the batch file is larger than {max_bytes} bytes")
    if not is_multipart:
        q = request.query_params
        data = await _read_body(request, max_bytes)
        from_file = await _file_input(gw, data, key)  # whatever its type: `curl -d` sends a form type
        if from_file is not None:
            return from_file
        return BatchInput(data, _options(q.get("webhook"), q.get("metadata"), q.get("completion_window_s")))
    async with request.form(max_files=1, max_fields=8) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(
                422, ErrorCode.INVALID_REQUEST, "the multipart form needs a `file` part", field="file"
            )
        if upload.size is not None and upload.size > max_bytes:
            raise _too_large(f"the batch file is larger than {max_bytes} bytes")
        data = await upload.read()
        fields = {name: form.get(name) for name in ("webhook", "metadata", "completion_window_s")}
    return BatchInput(data, _options(*(v if isinstance(v, str) else None for v in fields.values())))


def _bad_request(message: str, field_name: str) -> ApiError:
    return ApiError(400, ErrorCode.INVALID_REQUEST, message, field=field_name)


async def _file_input(gw: GatewayDep, raw: bytes, key: ApiKey) -> BatchInput | None:
    """OpenAI's JSON body naming an uploaded file -> its input; None when `raw` is not such a body."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or "input_file_id" not in body:
        return None
    try:
        request = FileBatchRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise _bad_request(f"{where}: {first.get('msg', 'invalid')}", where) from exc
    try:
        window_s = parse_duration_s(request.completion_window)
    except ValueError as exc:
        raise _bad_request(f"completion_window: {exc}", "completion_window") from exc
    if window_s <= 0:
        raise _bad_request("completion_window must be a positive duration", "completion_window")
    files = FileStore(gw.redis)
    record = await files.record(request.input_file_id)
    text = await files.text(request.input_file_id) if record is not None else None
    if record is None or text is None or not may_access(key, record.get(keys.OWNER_FIELD)):
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no file {request.input_file_id}", field="input_file_id")
    if record["purpose"] != "batch":
        raise _bad_request(f"file {request.input_file_id} has purpose {record['purpose']}, not batch", "input_file_id")
    options = BatchOptions(webhook=request.webhook, metadata=request.metadata or {}, completion_window_s=window_s)
    fields = {
        "input_file_id": request.input_file_id,
        "endpoint": request.endpoint,
        "completion_window": request.completion_window,
    }
    return BatchInput(text.encode(), options, request.endpoint, fields)


def _parse(
    data: bytes, max_lines: int, endpoint: str | None, served_model: str | None
) -> tuple[list[BatchLine], list[BatchLineError], list[str]]:
    """Validate and encode the lines (CPU work: run off the event loop)."""
    lines, errors = parse_batch(data, max_lines, endpoint, served_model)
    return lines, errors, [] if errors else [line.to_json() for line in lines]


@router.post(
    "",
    status_code=202,
    response_model=Batch,
    responses={422: {"model": BatchErrorResponse, "description": "bad lines: every one in error.data"}},
)
async def create_batch(
    request: Request,
    response: Response,
    store: StoreDep,
    gw: GatewayDep,
    key: ApiKeyDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=256)] = None,
) -> Batch | JSONResponse:
    """Validate a batch file (every bad line reported) and queue its lines as `batch`-priority jobs. With an
    `Idempotency-Key` (per API key, kept idempotency_ttl_s), a retry answers the batch the first request made."""
    settings, base = gw.settings, gw.base_url(request)
    given = await _input(request, gw, key)
    data, options = given.data, given.options
    if len(data) > settings.batch_max_bytes:
        raise _too_large(f"the batch file is larger than {settings.batch_max_bytes} bytes")
    try:
        served_model = await gw.served_model.name()  # None until a worker said what it serves: any model then
        lines, errors, encoded = await asyncio.to_thread(
            _parse, data, settings.batch_max_lines, given.endpoint, served_model
        )
    except BatchTooLarge as exc:
        raise _too_large(str(exc)) from exc
    if errors:
        info = BatchErrorInfo(
            code="invalid_batch",
            message=f"{len(errors)} bad line(s); the batch was not accepted",
            field="file",
            data=errors,
        )
        return JSONResponse(BatchErrorResponse(error=info).model_dump(exclude_none=True), status_code=422)
    await check_webhook(options.webhook, settings)
    made_of = [data, options.model_dump(mode="json"), given.endpoint, given.fields]  # lines, options, endpoint
    idempotency = Idempotency.of(idempotency_key, "batch", key.id, made_of, settings.idempotency_ttl_s)
    try:
        made = await made_by(store.redis, idempotency) if idempotency else None  # a retry: no quota taken twice
        if made is None:
            made = await _make(store, encoded, options, given, key.id, idempotency, settings, served_model)
    except IdempotencyConflict as exc:  # made from another input (before, or by a request racing this one)
        raise ApiError(422, ErrorCode.CONFLICT, str(exc), field="Idempotency-Key") from exc
    batch = await _load(store, made, base)
    response.headers["Location"] = batch.urls.get
    return batch


async def _make(
    store: BatchStore,
    encoded: list[str],
    options: BatchOptions,
    given: BatchInput,
    owner: str,
    idempotency: Idempotency | None,
    settings: ServiceSettings,
    served_model: str | None,  # OpenAI's Batch names the model that runs its lines
) -> str:
    """Store a new batch of the validated lines -> its id (the key's quota and the window checked first)."""
    await _check_quota(store, owner, len(encoded), settings.batch_max_pending_lines_per_key, settings.retry_after_s)
    window_s = options.completion_window_s or settings.batch_completion_window_s
    if window_s > settings.max_ttl_s:  # a line's job waits at most max_ttl_s (shared/submit.py): so would the batch
        name = "completion_window" if given.fields else "completion_window_s"
        raise _bad_request(f"{name}: at most {settings.max_ttl_s:g} s (max_ttl_s: no job waits longer)", name)
    fields = given.fields or {"completion_window": f"{window_s:g}s"}
    if served_model:
        fields = {**fields, "model": served_model}
    return await store.create(
        encoded, options.webhook, options.metadata, window_s, owner=owner, fields=fields, idempotency=idempotency
    )


async def _check_quota(store: BatchStore, owner: str, num_lines: int, limit: int, retry_after_s: int) -> None:
    """The key's quota of unfinished batch lines (shared/batch_quota.py): past it, 429."""
    if limit == 0:
        return
    num_pending = await store.num_pending_lines(owner)
    if num_pending + num_lines > limit:
        raise ApiError(
            429,
            ErrorCode.RATE_LIMITED,
            f"this key's batches have {num_pending} unfinished lines; {num_lines} more would pass its batch quota "
            f"of {limit} (batch_max_pending_lines_per_key): retry when some have finished",
            field="file",
            headers={"Retry-After": str(retry_after_s)},
        )


async def _load(store: BatchStore, batch_id: str, base: str) -> Batch:
    fields = await store.get(batch_id)
    if fields is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no batch {batch_id}", field="batch_id")
    return batch_from_fields(fields, base)


@router.get("", response_model=BatchList)
async def list_batches(
    request: Request,
    store: StoreDep,
    gw: GatewayDep,
    key: ApiKeyDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=80)] = None,
) -> BatchList:
    """Batches, newest first; `after` = the last id of the previous page."""
    index = keys.BATCHES_ZSET if key.is_admin else keys.batches_of(key.id)  # a tenant lists its own
    rows, has_more = await store.page(limit, after, index)
    data = [batch_from_fields(fields, gw.base_url(request)) for fields in rows]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


@router.get("/{batch_id}", response_model=Batch)
async def get_batch(batch_id: BatchId, request: Request, store: StoreDep, gw: GatewayDep) -> Batch:
    """The batch: status, `*_at` times, live request_counts."""
    return await _load(store, batch_id, gw.base_url(request))


@router.get(
    "/{batch_id}/results",
    response_model=None,
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/jsonl": {}}, "description": "one result line per finished input"}
    },
)
async def batch_results(
    batch_id: BatchId, request: Request, store: StoreDep, gw: GatewayDep
) -> StreamingResponse:
    """JSONL in input order: `custom_id` with `response{status_code, body}` or `error` (lines finished so far)."""
    batch = await _load(store, batch_id, gw.base_url(request))
    return StreamingResponse(
        store.results(batch_id, batch.request_counts.total), media_type="application/jsonl"
    )


@router.post("/{batch_id}/cancel", response_model=Batch)
async def cancel_batch(batch_id: BatchId, request: Request, store: StoreDep, gw: GatewayDep) -> Batch:
    """Cancel: queued lines are cancelled, running ones finish; finished lines stay in the results."""
    result = await store.cancel(batch_id)
    if result == "missing":
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no batch {batch_id}", field="batch_id")
    if result not in ("ok", BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value):
        raise ApiError(409, ErrorCode.CONFLICT, f"batch {batch_id} can no longer be cancelled: {result}")
    return await _load(store, batch_id, gw.base_url(request))
