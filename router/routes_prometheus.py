"""Prometheus service discovery: ``GET /v1/prometheus/targets`` (any valid key).

The answer is Prometheus' HTTP service-discovery format (``http_sd_configs``): target groups
labelled ``group``, ``replica`` and ``component``, with ``__scheme__`` and ``__metrics_path__``
taken from the replica's URL. A replica that heartbeats (a sidecar) is two targets on its public
address: ``component="sidecar"`` at ``/metrics`` (its ``mixfleet_replica_*`` metrics) and
``component="engine"`` at ``/engine/metrics`` (its engine's ``sglang:*`` metrics, which the
sidecar relays). A replica listed in the preset is one target, ``component="static"``, at its
URL's ``/metrics``. Preset replicas are always listed; a heartbeat replica is listed while the
router heard from it (itself or through the shared state) within
``TARGET_STALE_HEARTBEATS x heartbeat_timeout_s``, so a replica that scaled away leaves the
targets instead of staying down in Prometheus.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from router.auth import require
from router.context import RouterContext
from router.errors import AUTH, error_responses
from router.json_route import JsonRoute

TARGET_STALE_HEARTBEATS = 6

router = APIRouter(tags=["ops"], responses=error_responses(*AUTH), route_class=JsonRoute)


class PrometheusTargetGroup(BaseModel):
    """One target group of Prometheus' HTTP service discovery."""

    targets: list[str] = Field(description="host:port of the replica")
    labels: dict[str, str] = Field(description="group, replica, component, __scheme__ and __metrics_path__")


@router.get(
    "/v1/prometheus/targets",
    response_model=list[PrometheusTargetGroup],
    dependencies=[Depends(require("any"))],
    summary="Every replica as a Prometheus HTTP service-discovery target (http_sd_configs)",
)
async def targets(request: Request) -> list[dict]:
    ctx: RouterContext = request.app.state.ctx
    horizon = time.monotonic() - TARGET_STALE_HEARTBEATS * ctx.config.heartbeat_timeout_s
    out = []
    for r in sorted(ctx.registry.replicas.values(), key=lambda r: (r.group, r.replica_id)):
        if not r.static and r.last_seen < horizon:
            continue
        url = urlsplit(r.url)
        base = url.path.rstrip("/")
        paths = {"static": "/metrics"} if r.static else {"sidecar": "/metrics", "engine": "/engine/metrics"}
        for component, path in paths.items():
            labels = {"group": r.group, "replica": r.replica_id, "component": component}
            labels |= {"__scheme__": url.scheme, "__metrics_path__": base + path}
            out.append({"targets": [url.netloc], "labels": labels})
    return out
