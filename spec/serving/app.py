"""The FastAPI app: the routes, errors in the OpenAI envelope, the models loaded in the app's lifespan, the Gate in
front.

    app = create_app(engine, "tiny", load=lambda: load_pair("tiny"))

While `load` runs (on a thread, so that the server already answers), GET /health says 503 "loading"; once it
returns, the engine starts. A load that fails calls `on_load_error` with the exception (the command line stops
the server). Without `load`, the engine must already be started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException

from spec.models import Pair
from spec.serving.engine import Engine
from spec.serving.gate import Gate
from spec.serving.routes import Served, router
from spec.serving.schemas import ApiError

logger = logging.getLogger("spark-spec.server")


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_body: int = 1 << 20,
               max_model_len: int | None = None, load: Callable[[], Pair] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> Gate:
    """The app behind the Gate. `max_model_len` caps prompt + max_tokens below the model's context."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(_load(engine, load, on_load_error)) if load else None
        yield
        if loading and not loading.done():
            loading.cancel()

    app = FastAPI(title="spark-spec", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible speculative decoding: same answers, fewer target steps.")
    app.state.served = Served(engine, model_name, max_model_len, created=int(time.time()))
    app.include_router(router)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
    app.openapi = lambda: _openapi(app)
    return Gate(app, api_key, max_body)


async def _load(engine: Engine, load: Callable[[], Pair], on_error: Callable[[BaseException], None] | None):
    try:
        engine.start(await asyncio.to_thread(load))
    except (Exception, SystemExit) as err:  # SystemExit: the CLI's clear message for a model that cannot load
        logger.error("the models could not be loaded: %s", err)
        if on_error:
            on_error(err)


async def _api_error(request, err: ApiError):
    return err.response()


async def _invalid(request, err: RequestValidationError):
    """FastAPI's 422 becomes OpenAI's 400, naming the field."""
    first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the body is not valid JSON: {reason}".rstrip(": "), code="invalid_json").response()
    # loc is ("body", field, index, ..., union member); the member names a type, not a place.
    loc = [str(part) for part in first.get("loc", ())[1:]]
    loc = [part for part in loc if part not in ("str", "int", "float", "bool") and "[" not in part]
    param = ".".join(loc) or None
    text = first["msg"].removeprefix("Value error, ")
    message = f"{param}: {text}" if param else f"the body must be a JSON object with the request's fields: {text}"
    return ApiError(400, message, param=param, code="invalid_value").response()


async def _http(request, err: HTTPException):
    return ApiError(err.status_code, str(err.detail), headers=err.headers).response()


def _openapi(app: FastAPI) -> dict:
    """The schema, saying what the server really answers: invalid requests get 400 in the OpenAI envelope, never
    FastAPI's 422."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
