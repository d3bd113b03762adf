"""Log records of every service: plain text (default) or one JSON object a line (`log_json`, SPECFLEET_LOG_JSON).

A record carries the job it is about and the API key's *name* when the code runs for one: the gateway binds
them per request (gateway/request_context.py, gateway/auth.py), the worker per job. Key material never reaches
a record: the JSON formatter writes a fixed set of fields and masks anything shaped like an API key (`sf-…`) or
a webhook secret (`whsec_…`) in the message, whoever logged it.
"""

import contextlib
import contextvars
import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOB_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("specfleet_job_id", default=None)
KEY_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("specfleet_key_name", default=None)
CONTEXT_FIELDS = ("job_id", "key_name")
SECRET_PATTERN = re.compile(r"\b(sf-|whsec_)[A-Za-z0-9_\-+/=]{8,}")


def mask_secrets(text: str) -> str:
    return SECRET_PATTERN.sub(lambda m: f"{m.group(1)}***", text)


@contextlib.contextmanager
def bound(job_id: str | None = None, key_name: str | None = None) -> Iterator[None]:
    """Records logged inside carry this job id / key name (None: leave the current one)."""
    tokens = []
    if job_id is not None:
        tokens.append((JOB_ID, JOB_ID.set(job_id)))
    if key_name is not None:
        tokens.append((KEY_NAME, KEY_NAME.set(key_name)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class ContextFilter(logging.Filter):
    """Adds `job_id` and `key_name` to each record (an `extra={"job_id": ...}` given by the caller wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "job_id", None) is None:
            record.job_id = JOB_ID.get()
        if getattr(record, "key_name", None) is None:
            record.key_name = KEY_NAME.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC ISO 8601), level, logger, message, job_id / key_name when known,
    exc (the traceback) when there is one. Nothing else of the record is written."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": mask_secrets(record.getMessage()),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                doc[name] = str(value)
        if record.exc_info:
            doc["exc"] = mask_secrets(self.formatException(record.exc_info))
        return json.dumps(doc, ensure_ascii=False)


def handler(json_logs: bool) -> logging.Handler:
    out = logging.StreamHandler()
    out.setFormatter(JsonFormatter() if json_logs else logging.Formatter(TEXT_FORMAT))
    out.addFilter(ContextFilter())
    return out


def configure(json_logs: bool, level: int = logging.INFO) -> None:
    """The root logger of this process: one handler, text or JSON (replaces earlier handlers)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler(json_logs))
    root.setLevel(level)


def uvicorn_log_config(json_logs: bool) -> dict[str, Any] | None:
    """uvicorn's `log_config` (applied in each gateway process): JSON lines for uvicorn's loggers and ours.
    None for text: uvicorn's own format, as before."""
    if not json_logs:
        return None
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter}},
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "json", "filters": ["context"]},
        },
        "root": {"handlers": ["default"], "level": "INFO"},
        "loggers": {
            "uvicorn": {"level": "INFO", "handlers": [], "propagate": True},
            "uvicorn.error": {"level": "INFO", "handlers": [], "propagate": True},
            "uvicorn.access": {"level": "INFO", "handlers": [], "propagate": True},
        },
    }
