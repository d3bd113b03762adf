"""/v1/files: OpenAI's Files API for the Batch workflow. Upload (multipart `file` + `purpose=batch`), list,
read, download, delete; per tenant (another key's file is 404, as an unknown one), up to
settings.file_max_bytes (413). A finished batch's output and error files are listed, read and deleted here too
(views of its results: workers/tasks/batch_files.py)."""

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.datastructures import UploadFile

from gateway.auth import may_access
from gateway.deps import ApiKeyDep, GatewayDep
from gateway.errors import ERROR_RESPONSES, ApiError
from gateway.file_store import FileStore, file_from_fields
from gateway.idempotency import Idempotency, IdempotencyConflict, made_by
from shared import keys
from shared.api_keys import ApiKey
from shared.file_schemas import (
    FILE_ID_PATTERN,
    LISTED_PURPOSES,
    PURPOSES,
    FileDeleted,
    FileList,
    FileObject,
    check_jsonl,
)
from shared.job_state import ErrorCode

router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERROR_RESPONSES)

FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN)]
MAX_FILENAME_CHARS = 256
JSONL_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {"application/jsonl": {}}, "description": "the file's bytes"}}


async def _store(gw: GatewayDep) -> FileStore:
    return FileStore(gw.redis)


StoreDep = Annotated[FileStore, Depends(_store)]


def _bad(message: str, field: str) -> ApiError:
    return ApiError(400, ErrorCode.INVALID_REQUEST, message, field=field)


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, ErrorCode.NOT_FOUND, f"no file {file_id}", field="file_id")


async def _read_upload(upload: UploadFile, max_bytes: int) -> bytes:
    if upload.size is not None and upload.size > max_bytes:
        raise ApiError(413, ErrorCode.TOO_LARGE, f"the file is larger than {max_bytes} bytes", field="file")
    data = await upload.read()
    if len(data) > max_bytes:
        raise ApiError(413, ErrorCode.TOO_LARGE, f"the file is larger than {max_bytes} bytes", field="file")
    return data


@router.post("", response_model=FileObject)
async def create_file(
    request: Request,
    store: StoreDep,
    gw: GatewayDep,
    key: ApiKeyDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=256)] = None,
) -> FileObject:
    """Upload a file (multipart: `file`, `purpose`); only `purpose=batch`, a JSONL file of request lines. With an
    `Idempotency-Key` (per API key, kept idempotency_ttl_s), a retry answers the file the first request made."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _bad("upload the file as multipart/form-data with `file` and `purpose` parts", "file")
    async with request.form(max_files=1, max_fields=4) as form:
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str) or purpose not in PURPOSES:
            raise _bad(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", "purpose")
        if not isinstance(upload, UploadFile):
            raise _bad("the multipart form needs a `file` part", "file")
        data = await _read_upload(upload, gw.settings.file_max_bytes)
        filename = (upload.filename or "upload.jsonl")[:MAX_FILENAME_CHARS]
    if problem := await asyncio.to_thread(check_jsonl, data):
        raise _bad(f"a batch file is JSONL: {problem}", "file")
    made_of = [data, filename, purpose]
    idempotency = Idempotency.of(idempotency_key, "file", key.id, made_of, gw.settings.idempotency_ttl_s)
    try:
        made = await made_by(store.redis, idempotency) if idempotency else None  # a retry: not a second file
        limit = gw.settings.file_max_per_key
        if made is None and await store.num_files(key.id, limit) >= limit:
            raise ApiError(409, ErrorCode.CONFLICT, f"this key has {limit} files: delete some first")
        return await store.create(data.decode("utf-8-sig"), len(data), filename, purpose, key.id, idempotency)
    except IdempotencyConflict as exc:
        raise ApiError(422, ErrorCode.CONFLICT, str(exc), field="Idempotency-Key") from exc


@router.get("", response_model=FileList)
async def list_files(
    store: StoreDep,
    key: ApiKeyDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    after: Annotated[str | None, Query(max_length=120)] = None,
    purpose: Annotated[str | None, Query(max_length=64)] = None,
) -> FileList:
    """The key's files, newest first (an admin key: every tenant's): its uploads and its finished batches' output
    and error files (`batch_output`); `after` = the last id of the previous page."""
    if purpose not in (None, *LISTED_PURPOSES):  # no file has it
        return FileList(data=[], first_id=None, last_id=None, has_more=False)
    index = keys.FILES_ZSET if key.is_admin else keys.files_of(key.id)
    rows, has_more = await store.page(limit, after, index, purpose)
    data = [file_from_fields(fields) for fields in rows]
    return FileList(
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=has_more
    )


async def _owned_record(store: FileStore, file_id: str, key: ApiKey) -> dict[str, str] | None:
    """An uploaded file's record when the key may see it; None when it names no uploaded file; 404 otherwise."""
    fields = await store.record(file_id)
    if fields is not None and not may_access(key, fields.get(keys.OWNER_FIELD)):
        raise _not_found(file_id)
    return fields


async def _owned_batch_file(store: FileStore, file_id: str, key: ApiKey) -> tuple[dict[str, str], str]:
    found = await store.batch_file(file_id)
    if found is None or not may_access(key, found[0].get(keys.OWNER_FIELD)):
        raise _not_found(file_id)
    return found


@router.get("/{file_id}", response_model=FileObject)
async def get_file(file_id: FileId, store: StoreDep, key: ApiKeyDep) -> FileObject:
    """An uploaded file's record, or a finished batch's output or error file's."""
    fields = await _owned_record(store, file_id, key)
    if fields is not None:
        return file_from_fields(fields)
    batch, kind = await _owned_batch_file(store, file_id, key)
    return await store.batch_file_object(batch, kind)


@router.get("/{file_id}/content", response_model=None, response_class=StreamingResponse, responses=JSONL_RESPONSE)
async def file_content(
    file_id: FileId, store: StoreDep, key: ApiKeyDep
) -> PlainTextResponse | StreamingResponse:
    """The file's bytes: an upload as it was sent; a batch's file as JSONL result lines in input order."""
    fields = await _owned_record(store, file_id, key)
    if fields is not None:
        text = await store.text(file_id)
        if text is None:
            raise _not_found(file_id)
        return PlainTextResponse(text, media_type="application/jsonl")
    batch, kind = await _owned_batch_file(store, file_id, key)
    return StreamingResponse(
        (line.encode() async for line in store.batch_lines(batch, kind)), media_type="application/jsonl"
    )


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: FileId, store: StoreDep, key: ApiKeyDep) -> FileDeleted:
    """Delete a file: an upload (batches already created from it keep their lines), or a batch's output or error
    file (the batch keeps its results: GET /v1/batches/{id}/results)."""
    fields = await _owned_record(store, file_id, key)
    if fields is None:
        batch, kind = await _owned_batch_file(store, file_id, key)  # 404 unless it is one of the key's
        await store.delete_batch_file(batch, kind)
        return FileDeleted(id=file_id, deleted=True)
    await store.delete(file_id, fields[keys.OWNER_FIELD])
    return FileDeleted(id=file_id, deleted=True)
