"""The batch API's shapes (OpenAI Batch's object, with our webhook and urls) and the batch hash <-> `Batch`."""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.batch_state import BatchStatus
from shared.file_schemas import batch_file_ids
from shared.schemas import MAX_METADATA_KEYS, ErrorInfo, WebhookDelivery, WebhookEvent
from shared.webhook_status import webhook_status_from


class BatchRequestCounts(BaseModel):
    total: int
    completed: int = 0  # lines whose job succeeded
    failed: int = 0  # lines whose job failed, was cancelled or expired (or never started: cancelled batch)


class BatchUsage(BaseModel):
    """Totals over the lines whose job finished, failed ones included (workers/worker/cost.py; each job's usage):
    OpenAI's token counts, and the engine time and its price."""

    input_tokens: int = 0  # prompt tokens
    output_tokens: int = 0  # generated tokens
    total_tokens: int = 0
    compute_s: float = 0.0  # engine seconds
    cost: float = 0.0  # at the workers' price_per_worker_hour

    @classmethod
    def of(cls, fields: dict[str, str]) -> "BatchUsage":
        """From the batch hash's sums (shared/batch_lua.py LINE_DONE)."""
        input_tokens, output_tokens = int(fields.get("input_tokens") or 0), int(fields.get("output_tokens") or 0)
        return cls(
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
            compute_s=float(fields.get("compute_s") or 0),
            cost=float(fields.get("cost") or 0),
        )


class BatchUrls(BaseModel):
    get: str
    results: str
    cancel: str


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    status: BatchStatus
    created_at: float  # unix seconds; the batch is `validating` from then
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    expires_at: float  # lines not started by then expire
    request_counts: BatchRequestCounts
    usage: BatchUsage = BatchUsage()
    metadata: dict[str, str] = Field(default_factory=dict)
    webhook: str | None = None
    webhook_status: dict[WebhookEvent, WebhookDelivery] | None = None
    urls: BatchUrls
    # OpenAI's fields: a batch made from an uploaded file names it and its endpoint; the window as given
    # ("24h"), or in seconds; an ended batch names its output and error files (GET /v1/files/{id}/content)
    input_file_id: str | None = None
    endpoint: str | None = None
    completion_window: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    model: str | None = None  # the model that runs its lines (the fleet's, when the batch was made)


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchLineError(BaseModel):
    line: int  # 1-based line number in the input file
    code: str
    message: str


class BatchErrorInfo(ErrorInfo):
    data: list[BatchLineError] = Field(default_factory=list)


class BatchErrorResponse(BaseModel):
    """422 for a batch with bad lines: every bad line in `error.data`."""

    error: BatchErrorInfo


class BatchOptions(BaseModel):
    """The non-file parts of `POST /v1/batches` (query parameters, or multipart form fields)."""

    webhook: str | None = Field(None, min_length=1, max_length=2048, pattern=r"^https?://")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=MAX_METADATA_KEYS)
    completion_window_s: float | None = Field(None, gt=0, allow_inf_nan=False)


class FileBatchRequest(BaseModel):
    """OpenAI's `POST /v1/batches` body: the lines come from an uploaded file (POST /v1/files)."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Literal["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/jobs"]  # every line's url
    completion_window: str = Field("24h", min_length=1, max_length=32)  # a duration: 24h, 90m, 3600s
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_KEYS)
    webhook: str | None = Field(None, min_length=1, max_length=2048, pattern=r"^https?://")  # ours


def batch_urls(base_url: str, batch_id: str) -> BatchUrls:
    base = f"{base_url.rstrip('/')}/v1/batches/{batch_id}"
    return BatchUrls(get=base, results=f"{base}/results", cancel=f"{base}/cancel")


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def batch_from_fields(fields: dict[str, str], base_url: str) -> Batch:
    """The API view of a batch from its hash (HGETALL, decoded)."""
    return Batch(
        id=fields["id"],
        status=BatchStatus(fields["status"]),
        created_at=float(fields["created_at"]),
        in_progress_at=_float(fields.get("in_progress_at")),
        finalizing_at=_float(fields.get("finalizing_at")),
        completed_at=_float(fields.get("completed_at")),
        failed_at=_float(fields.get("failed_at")),
        expired_at=_float(fields.get("expired_at")),
        cancelling_at=_float(fields.get("cancelling_at")),
        cancelled_at=_float(fields.get("cancelled_at")),
        expires_at=float(fields["expires_at"]),
        request_counts=BatchRequestCounts(
            total=int(fields["total"]),
            completed=int(fields.get("completed") or 0),
            failed=int(fields.get("failed") or 0),
        ),
        usage=BatchUsage.of(fields),
        metadata=json.loads(fields.get("metadata") or "{}"),
        webhook=fields.get("webhook") or None,
        webhook_status=webhook_status_from(fields),
        urls=batch_urls(base_url, fields["id"]),
        input_file_id=fields.get("input_file_id") or None,
        endpoint=fields.get("endpoint") or None,
        completion_window=fields.get("completion_window") or None,
        output_file_id=batch_file_ids(fields).get("output"),
        error_file_id=batch_file_ids(fields).get("errors"),
        model=fields.get("model") or None,
    )
