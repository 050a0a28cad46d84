"""Prometheus service discovery: ``GET /v1/prometheus/targets`` (any valid key).

The answer is Prometheus' HTTP service-discovery format (``http_sd_configs``): one target group
per replica the router knows of, whose target is the replica's public address (its sidecar,
whose ``/metrics`` carries the replica's and its engine's metrics) and whose labels are
``group`` and ``replica`` plus ``__scheme__`` and ``__metrics_path__`` taken from the replica's
URL. Replicas listed in the preset are always listed; a heartbeat replica is listed while the
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

TARGET_STALE_HEARTBEATS = 6

router = APIRouter(tags=["ops"], responses=error_responses(*AUTH))


class PrometheusTargetGroup(BaseModel):
    """One target group of Prometheus' HTTP service discovery."""

    targets: list[str] = Field(description="host:port of the replica")
    labels: dict[str, str] = Field(description="group, replica, __scheme__ and __metrics_path__")


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
        out.append(
            {
                "targets": [url.netloc],
                "labels": {
                    "group": r.group,
                    "replica": r.replica_id,
                    "__scheme__": url.scheme,
                    "__metrics_path__": url.path.rstrip("/") + "/metrics",
                },
            }
        )
    return out
