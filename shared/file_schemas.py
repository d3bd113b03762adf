"""OpenAI's File object and the ids of a batch's output and error files.

Uploaded files (`purpose: batch`) are stored per tenant (gateway/file_store.py). A finished batch's
`output_file_id` / `error_file_id` name views of its result lines (those with a `response`, those with an
`error`), read from the batch's results: they live as long as the batch does and take no extra space.
"""

import json
import re
from typing import Literal

from pydantic import BaseModel

from shared import keys
from shared.batch_state import BatchStatus

PURPOSES = ("batch",)  # what may be uploaded; a batch's files have purpose batch_output
BATCH_OUTPUT_PURPOSE = "batch_output"
LISTED_PURPOSES = (*PURPOSES, BATCH_OUTPUT_PURPOSE)  # GET /v1/files?purpose=
BATCH_FILE_KINDS = ("output", "errors")
_BATCH_FILE = re.compile(r"^file-(batch_[A-Za-z0-9]{1,64})-(output|errors)$")
FILE_ID_PATTERN = r"^file-[A-Za-z0-9_-]{1,100}$"


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int  # unix seconds
    filename: str
    purpose: str  # "batch" (uploaded) | "batch_output" (a batch's output or error file)
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def batch_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's `output` or `errors` file."""
    return f"file-{batch_id}-{kind}"


def parse_batch_file_id(file_id: str) -> tuple[str, str] | None:
    """(batch id, `output` | `errors`) of a batch's file id; None for an uploaded file's id."""
    match = _BATCH_FILE.match(file_id)
    return (match.group(1), match.group(2)) if match else None


def is_result_of_kind(line: str, kind: str) -> bool:
    """A batch result line belongs to the output file when it has a response, else to the errors file."""
    has_response = json.loads(line).get("response") is not None
    return has_response if kind == "output" else not has_response


def check_jsonl(data: bytes) -> str | None:
    """Why `data` is not a JSONL file of objects (UTF-8, one JSON object a line, blank lines allowed), or None."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return f"the file is not UTF-8: {exc}"
    num_lines = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            return f"line {number} is not valid JSON: {exc}"
        if not isinstance(value, dict):
            return f"line {number} is not a JSON object"
        num_lines += 1
    return None if num_lines else "the file has no lines"


def batch_ended_s(fields: dict[str, str]) -> float:
    """When a batch ended (its files' created_at)."""
    for name in ("completed_at", "cancelled_at", "expired_at", "failed_at", "created_at"):
        if fields.get(name):
            return float(fields[name])
    return 0.0


def batch_file_record(fields: dict[str, str], kind: str) -> dict[str, str] | None:
    """A batch's `output` or `errors` file as an uploaded file's record (the listing's row), from the batch hash;
    None when the batch has no such file, or it was deleted."""
    if kind not in batch_file_ids(fields) or fields.get(f"{kind}_deleted"):
        return None
    return batch_file_row(fields, kind)


def batch_file_row(fields: dict[str, str], kind: str) -> dict[str, str]:
    """The record of a file the batch has (batch_file_record checks that it has it)."""
    return {
        "id": batch_file_id(fields["id"], kind),
        "bytes": fields.get(f"{kind}_bytes") or "0",
        "created_at": repr(batch_ended_s(fields)),
        "filename": f"{fields['id']}_{kind}.jsonl",
        "purpose": BATCH_OUTPUT_PURPOSE,
        keys.OWNER_FIELD: fields.get(keys.OWNER_FIELD, ""),
    }


def batch_file_ids(fields: dict[str, str]) -> dict[str, str]:
    """kind -> file id of the files an ended batch exposes: `output` when a line succeeded, `errors` when one
    did not (OpenAI's output_file_id / error_file_id); none while it runs."""
    if not BatchStatus(fields["status"]).is_terminal:
        return {}
    ids = {}
    if int(fields.get("completed") or 0) > 0:
        ids["output"] = batch_file_id(fields["id"], "output")
    if int(fields.get("failed") or 0) > 0:
        ids["errors"] = batch_file_id(fields["id"], "errors")
    return ids
