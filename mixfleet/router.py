"""Run the router alone against the replicas a preset lists (mixfleet router --preset FILE).

``--workers N`` serves the port from N router processes (uvicorn's own workers, each building its
app with :func:`app_from_env`); they share everything that changes answers through ``--state
redis://...``, so N > 1 with ``memory`` state is refused. Their Prometheus metrics are one view:
with N > 1 the workers write them to a fresh private ``PROMETHEUS_MULTIPROC_DIR`` (created before
uvicorn spawns them, removed when the router stops, or by the next router when it was killed),
and a scrape of any worker reads every worker's (:mod:`router.metrics`). Its workers stop (SIGTERM)
when it ends, however it ended (:func:`app_from_env`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import glob
import json
import logging
import math
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from core.errors import UserError
from mixfleet.argtypes import log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="preset name or TOML file (groups, replica URLs)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="router processes serving the port (default 1; more than one needs --state redis://...)",
    )
    parser.add_argument("--state", default="memory", help="memory (default) or redis://host:port/db")
    parser.add_argument("--policy", default="capacity", choices=("capacity", "round_robin", "cost"))
    parser.add_argument(
        "--api-keys-file",
        default=None,
        help='JSON {"<token>": ["rollout", "trainer", "admin", "replica"]}; default: $MIXFLEET_API_KEYS',
    )
    parser.add_argument(
        "--insecure-no-auth", action="store_true", help="serve without API keys (logs a warning)"
    )
    parser.add_argument(
        "--max-version-lag",
        type=int,
        default=None,
        help="keep new turns off replicas lagging the latest version by more than this",
    )
    add_timeout_arguments(parser)
    add_store_arguments(parser)
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body in bytes (default 8 MiB); a trainer log-prob upload is held to "
        "its lease's size instead",
    )
    parser.add_argument(
        "--session-idle-timeout",
        type=float,
        default=3600.0,
        help="seconds without a turn (none running) until an open session is dropped (0: never; %(default)s)",
    )
    parser.add_argument("--f16-logprobs", action="store_true", help="store support log-probs as float16")
    add_memory_arguments(parser)
    parser.add_argument(
        "--mismatch-band",
        default="0.2,5",
        help="LOW,HIGH: trainer/sampler probability ratios outside it count as out of band (default 0.2,5)",
    )
    add_bound_arguments(parser)
    parser.add_argument(
        "--modal-app",
        default=None,
        help="the deployed Modal app whose servers (one per group) serve the fleet: pin every request "
        "to the chosen replica's container (default: none, a local fleet)",
    )
    parser.add_argument(
        "--affinity-queue-bound",
        type=int,
        default=8,
        help="a replica whose engine queue stays above this many waiting requests sheds its sessions' "
        "new turns to the least-loaded replica of its group (default 8)",
    )
    parser.add_argument(
        "--affinity-hold", type=float, default=5.0, help="seconds the queue must stay above it (default 5)"
    )
    add_model_arguments(parser)
    parser.add_argument("--log-level", type=log_level, default="info")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags naming the served model: its chat model (:func:`chat_values`) and vocabulary
    size (:func:`vocab_value`)."""
    parser.add_argument(
        "--chat-model",
        default=None,
        help="checkpoint directory whose tokenizer and chat template the per-session chat APIs "
        "(OpenAI, Anthropic) render with (default: none, they answer 503)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the served checkpoint's vocabulary size (config.json's vocab_size): input ids at or "
        "above it are refused before they reach an engine, which SGLang does not check (default: "
        "the --chat-model checkpoint's, else none checked)",
    )
    parser.add_argument(
        "--chat-family",
        default="auto",
        help="the chat model's renderer family: local (mixfleet init-model's) or qwen3 "
        "(default auto: detected from its tokenizer)",
    )


def add_timeout_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the router's timeouts (:func:`timeout_values`)."""
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds a replica stays in rotation after it last reported ready; one silent that long "
        "is lost and the requests running on it fail over (default 10)",
    )
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=600.0,
        help="seconds an engine request may go without a byte of its answer before it times out "
        "(retried once on the same replica while it stays in rotation, then elsewhere; default 600)",
    )
    parser.add_argument(
        "--lease-timeout", type=float, default=300.0, help="seconds before redelivery (default 300)"
    )


def timeout_values(args: argparse.Namespace) -> dict:
    """RouterConfig's timeout fields from :func:`add_timeout_arguments`' flags; UserError naming
    one that is not > 0 (``--engine-timeout``: not a positive, finite number)."""
    for name in ("heartbeat_timeout", "lease_timeout"):
        if not getattr(args, name) > 0:  # NaN too
            raise UserError(f"--{name.replace('_', '-')} must be > 0")
    engine_timeout = getattr(args, "engine_timeout", 600.0)
    if not 0 < engine_timeout < math.inf:  # NaN too
        raise UserError(
            f"--engine-timeout must be a positive, finite number of seconds, got {engine_timeout!r}"
        )
    return {
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "lease_timeout_s": args.lease_timeout,
        "engine_timeout_s": engine_timeout,
    }


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of what the router does to its weight store beyond publishing."""
    parser.add_argument(
        "--keep-store-versions",
        type=int,
        default=0,
        metavar="N",
        help="at the start of every weight job, delete the store's versions beyond the run's "
        "newest N, keeping what replicas serve and every delta's bases (0: never; default 0)",
    )


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of what a router process keeps in memory beyond its state."""
    parser.add_argument(
        "--context-cache-mb",
        type=int,
        default=256,
        help="MiB of the sessions' last engine inputs kept as JSON text, so a turn encodes only what "
        "it appends (0: none; default 256)",
    )
    parser.add_argument(
        "--heap-trim-interval",
        type=float,
        default=5.0,
        help="seconds between returns of the process's free C-heap pages to the system (glibc "
        "malloc_trim; 0: never; default 5)",
    )


BOUNDS = {  # flag -> (RouterConfig field, type, default, help); rules: router.state.retention
    "--retention": ("retention_s", float, 3600.0, "seconds an acknowledged trajectory stays readable"),
    "--keep-versions": (
        "keep_versions",
        int,
        16,
        "weight versions per group kept in detail (ledger, mismatch)",
    ),
    "--keep-updates": ("keep_updates", int, 1000, "ledger update records kept (older ones rolled up)"),
    "--replica-forget": ("replica_forget_s", float, 3600.0, "seconds before a silent replica is forgotten"),
    "--route-key-ttl": ("route_key_ttl_s", float, 3600.0, "seconds a /generate route key lives"),
    "--compact-interval": ("compact_interval_s", float, 60.0, "seconds between state compactions"),
}


def add_bound_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the state's bounds (:data:`BOUNDS`; the table in docs/architecture.md)."""
    for flag, (_field, kind, default, text) in BOUNDS.items():
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default {default:g})")


def bound_values(args: argparse.Namespace) -> dict:
    """RouterConfig's bound fields from :data:`BOUNDS`' flags; UserError naming one that is not > 0."""
    out = {}
    for flag, (name, _kind, default, _text) in BOUNDS.items():
        value = getattr(args, flag[2:].replace("-", "_"), default)
        if not value > 0:
            raise UserError(f"{flag} must be > 0, got {value}")
        out[name] = value
    return out


def check_state_form(state: str) -> None:
    """``--state``'s form (``memory`` or a Redis URL), or a UserError naming it (``mixfleet up``
    checks its own ``--state`` with this before it prepares anything)."""
    if not (state == "memory" or state.startswith(("redis://", "rediss://", "unix://"))):
        raise UserError(f"--state must be 'memory' or a redis:// URL, got {state!r}")
    if state != "memory":
        import redis.asyncio

        try:  # redis-py's own reading of the URL (no connection is made)
            redis.asyncio.ConnectionPool.from_url(state)
        except ValueError as exc:
            raise UserError(f"--state {state!r}: {exc}") from None


def build_config(args: argparse.Namespace):
    """RouterConfig from CLI arguments (the fleet from ``fleet_json``, a FleetSpec as JSON, when
    given, else from ``preset``) and the environment (the replicas' proxy auth headers from
    ``MIXFLEET_PROXY_KEY`` / ``MIXFLEET_PROXY_SECRET``; the weight routes' store, run and converter,
    :meth:`router.config.WeightsConfig.from_env`); raises UserError naming a bad value."""
    from fleet.specs import FleetSpec, load_preset
    from router.auth import load_keys
    from router.config import RouterConfig, WeightsConfig, proxy_auth_headers
    from router.mismatch import check_band

    shipped = getattr(args, "fleet_json", None)
    fleet = FleetSpec.model_validate_json(shipped) if shipped else load_preset(args.preset)
    keys = load_keys(args.api_keys_file)
    if not keys and not args.insecure_no_auth:
        raise UserError("no API keys: set MIXFLEET_API_KEYS or --api-keys-file, or pass --insecure-no-auth")
    check_state_form(args.state)
    workers = getattr(args, "workers", 1)
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and args.state == "memory":
        raise UserError(
            f"--workers {workers} needs --state redis://... (memory state cannot be shared between processes)"
        )
    weights = WeightsConfig.from_env()
    keep_store = getattr(args, "keep_store_versions", 0)
    if keep_store < 0:
        raise UserError(f"--keep-store-versions must be >= 0 (0: never prune), got {keep_store}")
    weights = dataclasses.replace(weights, keep_store_versions=keep_store or None)
    if getattr(args, "modal_app", None):
        from router.pinning import open_pins

        open_pins(args.modal_app, [g.name for g in fleet.groups])  # a client without the listing: one line
    if not args.session_idle_timeout >= 0:
        raise UserError("--session-idle-timeout must be >= 0")
    if args.context_cache_mb < 0:
        raise UserError("--context-cache-mb must be >= 0")
    if not args.heap_trim_interval >= 0:
        raise UserError("--heap-trim-interval must be >= 0")
    if not getattr(args, "affinity_hold", 5.0) >= 0:
        raise UserError("--affinity-hold must be >= 0")
    if getattr(args, "affinity_queue_bound", 8) < 0:
        raise UserError("--affinity-queue-bound must be >= 0")
    if args.max_body_bytes < 1024:
        raise UserError("--max-body-bytes must be at least 1024")
    if args.max_version_lag is not None and args.max_version_lag < 0:
        raise UserError("--max-version-lag must be >= 0")
    try:
        low, high = (float(x) for x in args.mismatch_band.split(","))
        band = check_band((low, high))
    except ValueError:
        raise UserError(
            f"--mismatch-band must be LOW,HIGH with 0 < LOW < 1 < HIGH, got {args.mismatch_band!r}"
        ) from None
    chat_model, chat_family = chat_values(args)
    return RouterConfig(
        fleet=fleet,
        state_url=args.state,
        api_keys=keys,
        auth_disabled=bool(args.insecure_no_auth and not keys),
        policy=args.policy,
        **timeout_values(args),
        max_version_lag=args.max_version_lag,
        max_body_bytes=args.max_body_bytes,
        f16_support_logprobs=args.f16_logprobs,
        context_cache_bytes=args.context_cache_mb * 2**20,
        heap_trim_s=args.heap_trim_interval or None,
        session_idle_s=args.session_idle_timeout or None,
        mismatch_band=band,
        engine_headers=proxy_auth_headers(),
        **bound_values(args),
        modal_app=getattr(args, "modal_app", None) or None,
        affinity_queue_bound=getattr(args, "affinity_queue_bound", 8),
        affinity_hold_s=getattr(args, "affinity_hold", 5.0),
        weights=weights,
        chat_model=chat_model,
        chat_family=chat_family,
        vocab_size=vocab_value(args, chat_model),
    )


def chat_values(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """RouterConfig's ``chat_model`` and ``chat_family`` from ``--chat-model`` / ``--chat-family``
    (``auto``: None), the model's renderer loaded once so that a directory it cannot use is one
    line at start (UserError naming it)."""
    from router.config import CHAT_FAMILIES

    raw = getattr(args, "chat_model", None)
    family = getattr(args, "chat_family", "auto")
    family = None if family in (None, "auto") else family
    if family is not None and family not in CHAT_FAMILIES:
        raise UserError(f"--chat-family must be auto or one of {', '.join(CHAT_FAMILIES)}, got {family!r}")
    if not raw:
        return None, family
    from router.chat.renderers import load_renderer

    path = Path(raw).expanduser().resolve()
    try:
        load_renderer(path, family)
    except (OSError, ValueError) as exc:
        raise UserError(f"--chat-model {raw}: cannot render chat with it: {exc}") from None
    return path, family


def vocab_value(args: argparse.Namespace, chat_model: Path | None) -> int | None:
    """RouterConfig's ``vocab_size``: ``--vocab-size`` (UserError below 1), else the chat model's
    ``config.json`` ``vocab_size`` (the checkpoint the fleet serves), else None (the router logs
    at start that input ids reach the engines unchecked against the vocabulary)."""
    size = getattr(args, "vocab_size", None)
    if size is not None:
        if size < 1:
            raise UserError(f"--vocab-size must be >= 1, got {size}")
        return size
    if chat_model is None:
        return None
    try:
        size = json.loads((chat_model / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):  # a tokenizer-only directory: none named
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None


ARGS_ENV = "MIXFLEET_ROUTER_ARGS"


def router_app(config):
    """The router app for ``config`` with the weight-sync admin routes (``config.weights``)."""
    from router.app import create_app
    from router.routes_weights import create_weights_router

    return create_app(config, extra_routers=[create_weights_router(config.weights)])


def default_args(**values) -> dict:
    """The arguments of ``mixfleet router`` as :func:`app_from_args` takes them: every option's
    default, overridden by ``values`` (option names with underscores; ``fleet_json`` may stand
    in for ``preset``)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args(["--preset", str(values.get("preset", ""))]))
    unknown = set(values) - set(defaults) - {"fleet_json"}
    if unknown:
        raise UserError(f"unknown router arguments: {', '.join(sorted(unknown))}")
    return {**defaults, **values}


def app_from_env():
    """uvicorn's app factory in every router worker: :func:`app_from_args` of the arguments
    :func:`run` left in ``MIXFLEET_ROUTER_ARGS`` (JSON). A worker of several
    (``router.metrics.SUPERVISOR_ENV`` set) is sent SIGTERM, uvicorn's own stop, when its
    supervisor ends however it ended (SIGKILL, the OOM killer), and exits at once when the
    supervisor is already gone: no orphan keeps serving the port."""
    raw = os.environ.get(ARGS_ENV)
    if not raw:
        raise UserError(f"{ARGS_ENV} is not set: start the router with `mixfleet router`")
    from router.metrics import SUPERVISOR_ENV

    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor:
        from launcher.children import die_with_parent

        die_with_parent(int(supervisor), signal.SIGTERM)
    return app_from_args(json.loads(raw))


def app_from_args(values: dict):
    """The router app of a router process (``mixfleet router``'s workers, the router on Modal):
    :func:`router_app` of :func:`build_config` of ``values`` (:func:`default_args`' shape), with
    this process's logging set up, its open-file limit raised
    (:func:`core.process.raise_open_file_limit`) and no ``_created`` series exported (every
    counter is its ``_total``)."""
    import prometheus_client

    from core.process import raise_open_file_limit

    args = argparse.Namespace(**values)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    raise_open_file_limit()
    prometheus_client.disable_created_metrics()
    app = router_app(build_config(args))
    tune_gc()
    return app


GC_THRESHOLD = (500_000, 50, 100)


def tune_gc() -> None:
    """The garbage collector of a router process: everything that exists once the app is built is
    frozen out of every collection (``gc.freeze``), and a young collection runs after
    :data:`GC_THRESHOLD` net allocations instead of CPython's 700 (``gc.set_threshold``). Each
    request in flight keeps a few hundred containers alive (its tasks, coroutines, futures and
    parsed body): at a threshold below what the requests in flight hold together, every turnover
    of them ran a young collection that traversed them all and found nothing to free. The
    threshold sits above that at 1,000 concurrent turns; cyclic garbage is still collected, in
    fewer, larger collections."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


STATE_PROBE_S = 1.0
"""How long :func:`check_state` waits for the state store at start."""


def check_state(url: str) -> None:
    """UserError naming ``url`` when a server answers there but not as Redis (an HTTP server,
    anything else on that port: :class:`router.state.base.StateNotAStore`). One that does not
    answer within :data:`STATE_PROBE_S` is not refused: the router starts and answers 503 until
    Redis is back, as when Redis goes down later."""
    if url == "memory":
        return
    from router.state.base import StateNotAStore, StateUnavailable
    from router.state.redis import RedisStore

    async def probe() -> None:
        store = RedisStore(url, outage_s=STATE_PROBE_S)
        try:
            await store.get_latest_version()
        except StateNotAStore as exc:
            raise UserError(f"--state {exc}") from None
        except StateUnavailable:
            pass
        finally:
            await store.close()

    asyncio.run(probe())


def run(args: argparse.Namespace) -> int:
    """Serve the router with uvicorn (which uses uvloop and httptools when they are installed)
    until it is stopped: ``--workers`` processes, each building its app with :func:`app_from_env`
    (the arguments are checked here first, so a bad one is one line and nothing starts)."""
    import uvicorn

    from router.metrics import SUPERVISOR_ENV

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    build_config(args)
    check_state(args.state)
    plain = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | None)}
    os.environ[ARGS_ENV] = json.dumps(plain)
    if args.workers > 1:
        os.environ[SUPERVISOR_ENV] = str(os.getpid())
    else:
        os.environ.pop(SUPERVISOR_ENV, None)
    with multiprocess_metrics(args.workers):
        uvicorn.run(
            "mixfleet.router:app_from_env",
            factory=True,
            workers=args.workers,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            server_header=False,
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
        )
    return 0


WORKER_HEALTHCHECK_S = 60
"""How long uvicorn's supervisor waits for a worker to answer its health ping before it SIGKILLs
the worker and starts another (``uvicorn/supervisors/multiprocess.py`` 214-230, 0.55). Its
default, 5 s, kills workers that are only slow: one still importing on a loaded host, or one
starved of CPU mid-turn, with every turn it serves."""


METRICS_DIR_PREFIX = "mixfleet-router-metrics-"
"""Name prefix of a router's metric directory, followed by its supervisor's pid and a dash."""


@contextlib.contextmanager
def multiprocess_metrics(workers: int) -> Iterator[str | None]:
    """With ``workers`` > 1: a fresh private directory in ``PROMETHEUS_MULTIPROC_DIR`` while the
    block runs (uvicorn spawns its workers with the ``spawn`` start method, ``uvicorn/_subprocess.py``
    18, so each imports prometheus-client anew with it set), removed with its files afterwards; its
    path (None with one worker, which keeps its metrics in memory). The directories that killed
    routers left behind are removed first (:func:`remove_stale_metric_dirs`)."""
    from router.metrics import MULTIPROC_ENV

    if workers <= 1:
        yield None
        return
    remove_stale_metric_dirs()
    path = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
    before = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = before
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_metric_dirs(root: str | None = None) -> list[str]:
    """Remove the metric directories in ``root`` (default: the temporary directory) whose router
    no longer runs (one killed before it could remove its own); their paths."""
    from core.process import process_alive

    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), f"{METRICS_DIR_PREFIX}*-*")):
        pid = os.path.basename(path).removeprefix(METRICS_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
