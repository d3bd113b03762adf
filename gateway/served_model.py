"""The model name clients see: settings.served_model_name, else the name of the model the workers publish
(keys.MODEL_INFO `model`: shared.openai_compat.served_name), read again every model_info_refresh_s. One per
gateway (gateway/deps.py), so two gateways in one process never share it."""

import time

from redis.asyncio import Redis

from gateway.errors import ApiError
from shared import keys
from shared.job_state import ErrorCode
from shared.openai_compat import served_name


class ServedModel:
    def __init__(self, redis: Redis, configured: str | None, refresh_s: float) -> None:
        self.redis = redis
        self.configured = configured  # settings.served_model_name
        self.refresh_s = refresh_s
        self._name: str | None = None
        self._fetched_at = -float("inf")

    async def name(self) -> str | None:
        """None while no worker has said what it serves (and none is configured)."""
        if self.configured:
            return self.configured
        if time.monotonic() - self._fetched_at >= self.refresh_s:
            self._fetched_at = time.monotonic()
            model: str | None = await self.redis.hget(keys.MODEL_INFO, "model")  # type: ignore[misc,assignment]
            self._name = served_name(model) if model else None
        return self._name

    async def check(self, requested: str | None) -> str:
        """The model to answer with; 404 when the request names another one."""
        served = await self.name()
        if requested and served and requested != served:
            raise not_found(requested, served)
        return served or requested or "specfleet"


def not_found(requested: str, served: str | None) -> ApiError:
    """The 404 of a model this fleet does not serve (`served`: None while no worker has said what it serves)."""
    serving = f"this fleet serves `{served}`" if served else "no worker has said what it serves yet"
    return ApiError(404, ErrorCode.NOT_FOUND, f"the model `{requested}` does not exist; {serving}", field="model")
