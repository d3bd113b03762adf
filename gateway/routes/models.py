"""GET /v1/models: the model this fleet serves (OpenAI's list shape); GET /v1/models/{model}: that model, or 404
in OpenAI's error shape (the openai client's `models.retrieve`)."""

import time
from typing import Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel

from gateway.deps import ApiKeyDep, GatewayDep
from gateway.model_versions import served_versions
from gateway.openai_errors import OPENAI_ERRORS, OpenAIRoute
from gateway.served_model import not_found

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute, responses=OPENAI_ERRORS)

STARTED_AT = int(time.time())


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specfleet"
    versions: list[str] = []  # specfleet's extension: model versions live workers serve (a job may pin one)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


@router.get("/models", response_model=ModelList)
async def list_models(gw: GatewayDep, key: ApiKeyDep) -> ModelList:
    """The served target model (empty until a worker has announced it), with the versions being served."""
    name = await gw.served_model.name()
    versions = await served_versions(gw.redis, gw.settings.worker_ttl_s)
    return ModelList(data=[Model(id=name, created=STARTED_AT, versions=versions)] if name else [])


@router.get("/models/{model:path}", response_model=Model)
async def retrieve_model(
    gw: GatewayDep,
    key: ApiKeyDep,
    model: str = Path(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$"),  # the route's path matches no newline
) -> Model:
    """The served model by its id (a path: ids such as `org/name` have a slash); 404 for any other."""
    name = await gw.served_model.name()
    if name is None or model != name:
        raise not_found(model, name)
    return Model(id=name, created=STARTED_AT, versions=await served_versions(gw.redis, gw.settings.worker_ttl_s))
