"""The operator's placement routes: `GET /v1/placement` and `POST /v1/placement`.

Place in the data flow: app.build_app adds them over a backend that changes its placement live
(`serving.backend.PlacementBackend`: both engine backends). GET answers the serving placement
as placement-file JSON (between two states while a change is under way). POST takes a placement
file as its JSON body (what `paraflex plan` writes), checks it as `--placement` is checked
(`Placement.from_dict`, then `serving.live_placement.check_placement`) and applies it live on a
worker thread (`change_placement`: paraflex/serving/live_placement.py), answering the actions
done with their durations, or the refusal: 400 (malformed, or for another config), 409 (cannot
fit, cannot be applied live, another change under way), 503 (an engine it needs is dead), 500
(an action failed; rolled back). It changes what the server runs, so it needs the API key: a
server started without `--api-key` answers 403. (The key itself is checked before any route,
guards.py.)
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from paraflex.errors import UserError
from paraflex.gateway.api_error import ApiError
from paraflex.gateway.request_body import check_json_media_type, read_body
from paraflex.placement import Placement
from paraflex.serving.backend import PlacementBackend
from paraflex.serving.live_placement import PlacementRejected

SOURCE = "POST /v1/placement"


def add_placement_routes(app, backend, api_key: str | None, doc) -> None:
    """GET and POST /v1/placement on `app` (see the module docstring); `doc`: the app's
    OpenApiDocument, for the error responses."""

    def live() -> PlacementBackend:
        if not isinstance(backend, PlacementBackend):
            raise ApiError(404, "this backend has no live placement")
        return backend

    @app.get("/v1/placement", responses=doc.errors(400, 401, 404, 503))
    async def get_placement():
        return live().placement().to_dict()

    @app.post("/v1/placement", responses=doc.errors(400, 401, 403, 404, 409, 413, 415, 500, 503))
    async def post_placement(request: Request):
        target = live()
        if api_key is None:
            raise ApiError(403, "POST /v1/placement changes what the server runs, so it needs the API key: start "
                                "the server with --api-key (or $PARAFLEX_API_KEY) and send 'Authorization: Bearer <key>'")
        check_json_media_type(request)
        try:
            body = json.loads(await read_body(request))
            placement = Placement.from_dict(body, source=SOURCE)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{SOURCE}: body is not valid JSON: {exc}; send a placement file "
                                "(`paraflex plan CONFIG -o placement.json`)") from None
        except UserError as exc:
            raise ApiError(400, str(exc)) from None
        try:
            report = await asyncio.to_thread(target.change_placement, placement, SOURCE)
        except PlacementRejected as exc:
            raise ApiError(exc.status, str(exc)) from None
        return {**report, "placement": target.placement().to_dict()}
