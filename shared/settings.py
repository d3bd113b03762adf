"""Service settings and their one set of defaults (the fields below); the engine's are in
workers/engine/config.py.

Precedence (highest first): constructor arguments (CLI flags), environment (`SPECFLEET_<FIELD>`, nested fields
with `__`, plus `REDIS_URL`), the YAML file (`SPECFLEET_CONFIG` or `configs/service.yaml`, overrides only),
the defaults below. An unknown key in the file is an error. Secrets come only from the environment;
`env: prod` refuses the built-in dev webhook secret.
"""

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from shared import keys
from shared.cpu_placement import parse_cpu_list
from shared.reasoning import ReasoningParser
from shared.redis_url import parse as parse_redis_url
from shared.schemas import MAX_STREAM_INTERVAL_MS, MODEL_VERSION_PATTERN, Priority
from shared.webhook_signing import DEV_WEBHOOK_SECRET

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG_PATH = REPO_ROOT / "configs" / "service.yaml"


def config_path() -> Path:
    return Path(os.environ.get("SPECFLEET_CONFIG", DEFAULT_CONFIG_PATH))


class _ByPriority(BaseModel):
    """A setting with one value per queue priority (its fields are named as Priority's values)."""

    def for_priority(self, priority: Priority) -> int:
        return int(getattr(self, priority.value))


class QueueLimits(_ByPriority):
    """Most jobs waiting per priority; beyond it a submit gets 503 with Retry-After."""

    interactive: int = Field(default=1_000, ge=1)
    default: int = Field(default=10_000, ge=1)
    batch: int = Field(default=100_000, ge=1)


class StreamIntervals(_ByPriority):
    """A job's token events at most once per this many ms, by its priority, unless its request names its own
    `stream_interval_ms` (workers/worker/stream_interval.py); 0: one event per engine step that gave it tokens.
    A batch's jobs are read when they end (its result file), not watched token by token: one event a second
    spares the fleet's I/O side nearly all of its per-token work for them."""

    interactive: int = Field(default=0, ge=0, le=MAX_STREAM_INTERVAL_MS)
    default: int = Field(default=0, ge=0, le=MAX_STREAM_INTERVAL_MS)
    batch: int = Field(default=1_000, ge=0, le=MAX_STREAM_INTERVAL_MS)


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SPECFLEET_", env_nested_delimiter="__", extra="forbid", populate_by_name=True
    )

    env: Literal["dev", "prod"] = "dev"
    # None: `specfleet up` starts a private redis-server; anything else points every process at that Redis.
    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("REDIS_URL", "SPECFLEET_REDIS_URL", "redis_url")
    )
    redis_dir: Path = Path(".specfleet/redis")  # data dir (AOF) of the private redis-server
    # hash-tag partitions of the fleet's keys (shared/keys.py): on a Redis Cluster, tenants spread over this many
    # slots. Fixed for a deployment's life: ids carry their partition, but a tenant's key maps to another one
    # when it changes (the README's "Redis topologies")
    redis_partitions: int = Field(default=1, ge=1, le=1024)
    # Celery's broker; None: REDIS_URL itself. Required when REDIS_URL is a Redis Cluster (kombu has no Cluster
    # transport): a small standalone or Sentinel Redis (shared/redis_url.py celery_broker)
    celery_broker_url: str | None = None

    @field_validator("redis_url", "celery_broker_url")
    @classmethod
    def _known_redis_form(cls, url: str | None) -> str | None:
        if url is not None:
            parse_redis_url(url)  # RedisUrlError (a ValueError) names the forms expected
        return url

    # gateway
    host: str = "127.0.0.1"
    # Redis connections per gateway process (+1 pub/sub); requests beyond it wait for a free one
    redis_max_connections: int = Field(default=64, ge=2)
    port: int = Field(default=8000, ge=0, le=65535)
    public_url: str | None = None  # base of `urls{}`; None: taken from each request
    queue_limits: QueueLimits = QueueLimits()
    retry_after_s: int = Field(default=1, ge=1)
    max_wait_s: float = Field(default=60.0, ge=0)  # cap of `Prefer: wait=N`
    sse_keepalive_s: float = Field(default=15.0, gt=0)
    model_info_refresh_s: float = Field(default=5.0, ge=0)

    # jobs
    default_ttl_s: float = Field(default=3600.0, gt=0)  # a job not started within its ttl_s expires
    max_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    result_ttl_s: int = Field(default=keys.RESULT_TTL_S, ge=1)
    idempotency_ttl_s: int = Field(default=keys.IDEMPOTENCY_TTL_S, ge=1)
    jobs_listed_per_key: int = Field(default=keys.JOBS_LISTED_PER_KEY, ge=0)  # GET /v1/jobs: the newest this many
    events_maxlen: int = Field(default=keys.EVENTS_MAXLEN, ge=100)
    # execution deadline of a job without `timeout_s`, counted from its first start (workers/worker/deadlines.py)
    job_timeout_s: float = Field(default=300.0, gt=0)
    stream_interval_ms: StreamIntervals = StreamIntervals()  # token events of a job at most this often

    # workers
    engine_config: Path = Path("configs/engine.yaml")
    claim_timeout_s: float = Field(default=30.0, gt=0)  # a held job idle this long belonged to a dead worker
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    reclaim_interval_s: float = Field(default=5.0, gt=0)
    max_deliveries: int = Field(default=3, ge=1)
    worker_ttl_s: float = Field(default=float(keys.WORKER_TTL_S), gt=0)
    starvation_limit: int = Field(
        default=8, ge=1
    )  # a waiting priority is served after being passed over this often
    idle_block_ms: int = Field(default=500, ge=1)  # how long an idle worker blocks on the queues per read
    # a thread pulls the jobs announced while the engine steps; the next step starts them (workers/worker/puller.py;
    # one partition off a Cluster: elsewhere the loop pulls at its boundaries only)
    pull_while_stepping: bool = True
    # the worker's loop waits for its writer process only once the oldest step not yet written was handed over this
    # long ago (or MAX_PENDING_STEPS are pending): a writer behind a fast engine then takes several steps in one
    # round trip, not one each while the engine waits (workers/worker/writer.py)
    writer_max_lag_ms: float = Field(default=20.0, gt=0)
    # while steps come one after another the writer process sleeps until the next is due and looks for it, instead
    # of waiting on the pipe, so the loop's send does not pay for waking it (workers/worker/writer_pacing.py);
    # auto: where the worker's start measured a wake-up costing its loop WAKE_COST_MIN_US more than a plain send
    writer_pacing: Literal["auto", "on", "off"] = "auto"
    shutdown_grace_s: float = Field(
        default=10.0, ge=0
    )  # on SIGTERM, finish held jobs within this, else hand back
    # run the engine over prefill, decode, speculation and every batch bucket before the first heartbeat
    # (workers/worker/warmup.py): /readyz turns ready only after it
    warm_up: bool = True
    # the named, versioned model configuration (target, draft, engine settings) a worker serves; jobs may pin it
    model_version: str = Field(default="v1", pattern=MODEL_VERSION_PATTERN)
    # price of one worker for an hour (any currency): a job's `cost` is its compute_s at this price; 0 = no cost
    price_per_worker_hour: float = Field(default=0.0, ge=0)
    # Prometheus /metrics of a worker process (workers/worker/engine_metrics.py) on `host`; 0 = off
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    # CPU placement (shared/cpu_placement.py). cpu_bind auto: `specfleet up` keeps the lowest `reserved_cpus`
    # cores for Redis, the gateway, the Celery worker and the worker's writer, and gives the engine the rest
    # (nothing is bound on a host with fewer cores than reserved_cpus + 1); off: the kernel places everything.
    cpu_bind: Literal["auto", "off"] = "auto"
    reserved_cpus: int = Field(default=1, ge=1)
    # a worker's engine cores (a CPU list, `1-3,5`): its torch threads run there, its writer process and heartbeat
    # on its other cores. Set by `specfleet up`; set it yourself for a worker started alone. Empty: not bound.
    engine_cpus: str = ""

    @field_validator("engine_cpus")
    @classmethod
    def _cpu_list(cls, value: str) -> str:
        parse_cpu_list(value)  # ValueError names the form expected
        return value

    # webhooks (workers/tasks/webhooks.py); the secret only from the environment (SPECFLEET_WEBHOOK_SECRET)
    webhook_secret: SecretStr = SecretStr(DEV_WEBHOOK_SECRET)  # whsec_<base64>; refused outside dev
    # hosts or CIDRs a webhook may reach although they are loopback/private/... (SSRF guard, shared/ssrf.py)
    webhook_allow_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_output_interval_ms: int = Field(default=500, ge=0)  # at most one `output` event per job per this
    webhook_timeout_s: float = Field(default=10.0, gt=0)  # one delivery attempt
    webhook_max_attempts: int = Field(default=8, ge=1)  # then the failure is recorded (`webhook_status`)
    webhook_retry_base_s: float = Field(default=5.0, gt=0)  # backoff: base * 2^(attempt-1), jittered
    webhook_retry_max_s: float = Field(default=600.0, gt=0)  # cap of one backoff (and of Retry-After)

    # batches (gateway/routes/batches.py, workers/tasks/batches.py)
    batch_max_lines: int = Field(default=50_000, ge=1)
    batch_max_bytes: int = Field(default=100 * 2**20, ge=1)
    batch_chunk_lines: int = Field(default=500, ge=1, le=5_000)  # lines submitted per expansion task
    batch_completion_window_s: float = Field(default=24 * 3600.0, gt=0)  # lines not started by then expire
    batch_result_ttl_s: int = Field(default=keys.BATCH_RESULT_TTL_S, ge=1)
    batch_retry_s: float = Field(default=2.0, gt=0)  # expansion retry delay when the batch queue is full
    # a running batch is re-checked this often: lines whose outbox notice was lost are counted from their jobs
    batch_reconcile_interval_s: float = Field(default=60.0, gt=0)
    # files (OpenAI's Files API, gateway/routes/files.py): the largest upload, and how many files a key keeps
    file_max_bytes: int = Field(default=100 * 2**20, ge=1)
    file_max_per_key: int = Field(default=1_000, ge=1)
    # the per-key batch quota (shared/batch_quota.py): lines of one key's batches queued or running at once (the
    # expansion adds more as they finish: tenants' batches progress together), and lines of its unfinished
    # batches (a batch past it is a 429); 0 = no limit
    batch_max_inflight_lines_per_key: int = Field(default=256, ge=0)
    batch_max_pending_lines_per_key: int = Field(default=200_000, ge=0)
    celery_concurrency: int = Field(default=4, ge=1)  # threads of the Celery worker `specfleet up` starts
    # Prometheus /metrics of the Celery worker (workers/tasks/metrics.py) on `host`; 0 = off
    tasks_metrics_port: int = Field(default=0, ge=0, le=65535)

    # logs: one JSON object a line (shared/logs.py) with job id and API key name; off = plain text
    log_json: bool = False

    # API keys and per-key limits (gateway/auth.py, gateway/rate_limit.py); keys live hashed in Redis
    # (`specfleet keys create`). env prod: the gateway refuses to start while no active key exists.
    rate_limit_period_s: float = Field(default=60.0, gt=0)  # the "minute" of requests/tokens per minute
    default_requests_per_min: int = Field(default=600, ge=0)  # of a new key; 0 = unlimited
    default_tokens_per_min: int = Field(default=1_000_000, ge=0)
    default_max_concurrent_jobs: int = Field(default=64, ge=0)

    # request hardening (gateway/body_limit.py, gateway/openai_api.py)
    max_request_bytes: int = Field(default=1 << 20, ge=1024)  # any body but a batch file; larger -> 413
    max_prompt_chars: int = Field(default=200_000, ge=1)  # prompt, or all messages' content together
    max_tokens_limit: int = Field(default=32_768, ge=1)  # the largest max_tokens a request may ask
    cors_allow_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)  # empty: CORS off

    # OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models)
    openai_priority: Priority = Priority.INTERACTIVE  # of their jobs unless the body says `priority`
    cancel_on_disconnect: bool = True  # a client that goes away cancels its job (frees the GPU)
    served_model_name: str | None = None  # `model` of /v1/models; None: the workers' model dir name
    # a reasoning model's thinking as chat answers' `reasoning_content` (shared/reasoning.py): none | qwen3 | deepseek_r1
    reasoning_parser: ReasoningParser = "none"

    @field_validator("webhook_allow_hosts", "cors_allow_origins", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _no_default_secret_in_prod(self) -> "ServiceSettings":
        if self.env != "dev" and self.webhook_secret.get_secret_value() == DEV_WEBHOOK_SECRET:
            raise ValueError("set SPECFLEET_WEBHOOK_SECRET (whsec_...): the default secret is for dev only")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_source = YamlConfigSettingsSource(settings_cls, yaml_file=config_path())
        return init_settings, env_settings, yaml_source


def with_model_version(settings: ServiceSettings, model_version: str) -> ServiceSettings:
    """The settings serving another model version (`--model-version`); ValueError when it is not a valid name."""
    if not re.fullmatch(MODEL_VERSION_PATTERN, model_version):
        raise ValueError(f"model version {model_version!r} does not match {MODEL_VERSION_PATTERN}")
    return settings.model_copy(update={"model_version": model_version})


@lru_cache(maxsize=1)
def get_settings() -> ServiceSettings:
    return ServiceSettings()
