"""The browser side of `minillm serve`: the page at /, the planner at /plan, and the JSON they read.

    GET /, /plan, /static/*    the page's files (minillm/serve/static: plain JS, canvas and SVG, no build
                               step, nothing from the network), open: they hold code, no data
    GET /api/info              the served model (name, context, KV block size), for the page's controls
    GET /api/live              the live engine view (live.py) as server-sent events
    GET /api/plan[/options]    the capacity planner (minillm/tools/planner.py's PlannerAPI), when one was passed in

The /api routes sit behind the API key like /v1 (the page asks for the key once and sends it as a
Bearer header; it reads the event stream with fetch, since EventSource cannot send headers). The
Guard's Host check covers every route here too.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from minillm.serve.guard import require_api_key
from minillm.serve.protocol import ApiError, error_responses

STATIC_DIR = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0            # a comment line this often on a quiet stream: a closed tab is noticed
# The page runs only its own files: no inline script, nothing from another origin.
PAGE_HEADERS = {"content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                "x-content-type-options": "nosniff", "cache-control": "no-cache"}


def add_web(app: FastAPI, server, planner=None) -> None:
    """Mount the page, its files and its /api routes on `app` (server: the OpenAIServer; planner: an
    object with `options()` and `plan(query)`, e.g. minillm.tools.planner.PlannerAPI(), or None)."""
    app.include_router(page_routes())
    app.include_router(api_routes(server, planner))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def page_routes() -> APIRouter:
    pages = APIRouter(include_in_schema=False)
    for path, name in (("/", "index.html"), ("/plan", "plan.html")):
        pages.get(path)(_page(STATIC_DIR / name))
    return pages


def _page(file: Path):
    async def page() -> FileResponse:
        return FileResponse(file, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)
    return page


def api_routes(server, planner) -> APIRouter:
    key = server.options.api_key
    api = APIRouter(prefix="/api", dependencies=[Depends(require_api_key(key))],
                    responses=error_responses(401) if key else {})

    @api.get("/info")
    async def info() -> dict:
        engine = server.loop.engine
        return {"model": server.model_name, "context": server.llm.config.max_seq_len,
                "block_size": engine.pool.block_size, "blocks": engine.pool.num_blocks,
                "max_batch": engine.scheduler.max_batch, "planner": planner is not None}

    @api.get("/live", response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}})
    async def live(request: Request) -> StreamingResponse:
        return StreamingResponse(_events(server.loop), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    @api.get("/plan/options", responses=error_responses(404))
    async def plan_options() -> dict:
        return _planner(planner).options()

    @api.get("/plan", responses=error_responses(400, 404))
    async def plan(request: Request) -> dict:
        try:
            return _planner(planner).plan(dict(request.query_params))
        except ValueError as e:              # the planner's PlanError: a bad slider value, one line
            raise ApiError(400, str(e), code="invalid_plan") from None
    return api


def _planner(planner):
    if planner is None:
        raise ApiError(404, "this server was started without the planner", code="not_found")
    return planner


async def _events(loop):
    """Every update of the live view as one SSE event; the listener goes away with the connection."""
    queue = loop.watch()
    try:
        while True:
            try:
                text = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"
                continue
            yield f"data: {text}\n\n"
    finally:
        loop.live.unsubscribe(queue)
