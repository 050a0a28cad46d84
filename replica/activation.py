"""Activation of one weight version on one engine: the one protocol, for SGLang and the local engine.

:func:`activate` runs, on an engine that is serving (sampling under load included):

1. ``POST /pause_generation {"mode": "retract"}``: the scheduler stops, moves every running
   request back to the waiting queue and frees its KV cache (SGLang 0.5.23
   ``managers/scheduler.py`` 5817-5932); new requests wait (``managers/tokenizer_manager.py``
   925-940, 2267-2280).
2. ``POST /update_weights_from_disk`` with :func:`core.sglang_release.update_weights_request`
   (``flush_cache: true``). The scheduler swaps the weights, records the new version (a span
   event for every live request with output, waiting ones included: ``scheduler.py`` 5636-5655,
   ``utils/weight_versions.py`` 38-52), then flushes: allowed because the running batch is empty
   and waiting requests are ignored while paused (``scheduler.py`` 5518-5548, 5337-5360), so the
   radix cache holds no prefix KV of the old version afterwards.
3. The scheduler may still refuse that flush: ``is_fully_idle`` also waits for a queued
   overlap-scheduler result, a compiling grammar or HiCache transfers (``scheduler.py``
   5337-5400). The engine then answers 400 ``success: false``, "Weights were updated, but the
   cache was not flushed ..." (``managers/scheduler_components/weight_updater.py`` 120-160;
   ``entrypoints/http_server.py`` 1299-1325): it already serves the new weights under the new
   version, but ``/model_info`` names the old one (``tokenizer_manager.py`` 2316-2322). Still
   paused, :func:`activate` sends ``POST /flush_cache`` until it succeeds (a few tries), then
   ``POST /update_weight_version`` (``http_server.py`` 1527-1556) so ``/model_info`` names the
   version served. Never a second load: the weights are already in.
4. ``POST /continue_generation`` (always, retried: a paused engine serves nobody). Retracted
   requests are re-prefilled -- prompt plus the output so far -- under the new weights and go on.
5. The version is confirmed from ``/model_info`` (``http_server.py`` 812-830 ``weight_version``).

What the version of a token means: the weights of the forward step that produced its
distribution, with the whole prefix KV it attended to computed by that same version. A request
that crossed the activation has spans ``[old: 0..k), [new: k..n)`` (SGLang's ``weight_versions``):
tokens before ``k`` were sampled under the old weights; the retract dropped their KV, and token
``k`` onwards was sampled after a re-prefill of prompt and tokens ``< k`` under the new weights.
The flush leaves no old-version prefix for a later turn to reuse from the radix cache.

Why not ``in_place`` + ``flush_cache: false`` + a flush once idle (Stitch's protocol): requests
held in place keep their old-version KV, and under sustained agent load the engine is never idle,
so the flush never happens and later turns keep reusing old-version prefix KV from the radix
cache while their spans name the new version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from clients.engine import EngineError, EngineRejected, SGLangClient, WeightsNotFlushed
from core import sglang_release as release

__all__ = ["ActivationFailed", "ActivationTimes", "activate"]

log = logging.getLogger("mixfleet.activation")

FLUSH_TRIES = 10  # /flush_cache attempts after an update whose own flush was refused
CONTINUE_TRIES = 20


class ActivationFailed(Exception):
    """The engine did not come to serve ``version``; ``message`` says why, naming the version.
    ``weights_loaded``: the engine swapped the weights (it may serve them under a version its
    ``/model_info`` does not name)."""

    def __init__(self, version: int, message: str, *, weights_loaded: bool = False) -> None:
        super().__init__(message)
        self.version = version
        self.message = message
        self.weights_loaded = weights_loaded


@dataclass(frozen=True)
class ActivationTimes:
    """Where one activation's time went, in seconds, and the engine's update message."""

    pause_s: float  # /pause_generation sent -> /continue_generation answered
    update_s: float  # /update_weights_from_disk alone
    message: str


async def activate(
    engine: SGLangClient, model_path: str, version: int, weight_format: str, *, timeout_s: float = 600.0
) -> ActivationTimes:
    """Make ``engine`` serve ``version`` from the checkpoint at ``model_path`` (``weight_format``)
    by the protocol in the module docstring. Returns once ``/model_info`` names ``version``; the
    engine is never left paused knowingly: a ``/continue_generation`` it refuses every time is an
    :class:`ActivationFailed` too. Raises :class:`ActivationFailed` otherwise (a refused update keeps
    the old version serving). ``timeout_s`` bounds the update call."""
    request = release.update_weights_request(model_path, version, weight_format)
    t0 = time.perf_counter()
    try:
        await engine.pause_generation(release.PAUSE_MODE)
    except EngineError as exc:
        raise ActivationFailed(
            version, f"engine did not pause for version {version}: {exc.message}"
        ) from None
    continued = False
    try:
        update_s, message = await _update(engine, request, version, timeout_s)
    finally:
        continued = await _continue(engine)
    if not continued:
        raise ActivationFailed(
            version,
            f"engine stayed paused after taking version {version}: /continue_generation failed "
            f"{CONTINUE_TRIES} times",
            weights_loaded=True,
        )
    pause_s = time.perf_counter() - t0
    try:
        served = await engine.weight_version(timeout=10.0)
    except EngineError as exc:
        message = f"engine did not say its version after updating to {version}: {exc.message}"
        raise ActivationFailed(version, message, weights_loaded=True) from None
    if served != version:
        raise ActivationFailed(
            version, f"engine reports version {served} after updating to {version}", weights_loaded=True
        )
    return ActivationTimes(pause_s=pause_s, update_s=update_s, message=message)


async def _update(engine: SGLangClient, request: dict, version: int, timeout_s: float) -> tuple[float, str]:
    """The update while paused; the recovery of step 3 when only its flush was refused."""
    t_u = time.perf_counter()
    try:
        message = await engine.update_weights_from_disk(request, timeout=timeout_s)
    except WeightsNotFlushed as exc:
        log.warning("engine took version %d but refused the flush (%s); flushing while paused", version, exc)
        await _flush(engine, version)
        try:
            await engine.update_weight_version(version)
        except EngineError as err:
            raise ActivationFailed(
                version, f"engine did not take version {version}: {err.message}", weights_loaded=True
            ) from None
        message = exc.message
    except EngineRejected as exc:
        raise ActivationFailed(version, f"engine refused version {version}: {exc.message}") from None
    except EngineError as exc:
        raise ActivationFailed(version, f"engine unreachable during update: {exc.message}") from None
    return time.perf_counter() - t_u, message


async def _flush(engine: SGLangClient, version: int) -> None:
    """``/flush_cache`` until it succeeds (FLUSH_TRIES, backing off); ActivationFailed after."""
    last = ""
    for attempt in range(FLUSH_TRIES):
        try:
            await engine.flush_cache()
            return
        except EngineError as exc:
            last = exc.message
        await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
    raise ActivationFailed(
        version,
        f"engine serves the weights of version {version} but refused to flush its cache: {last}",
        weights_loaded=True,
    )


async def _continue(engine: SGLangClient) -> bool:
    """``/continue_generation``, retried (a paused engine serves nobody); whether it was answered."""
    for attempt in range(CONTINUE_TRIES):
        try:
            await engine.continue_generation()
            return True
        except EngineError as exc:
            log.warning("continue_generation failed (attempt %d): %s", attempt + 1, exc)
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
    return False
