"""What ``modal deploy deploy/modal_app.py`` creates for a preset, checked before anything is deployed.

:func:`check` lists every problem of a fleet for Modal, one line each: errors (a GPU string Modal
does not know, a CPU group, a count that disagrees with ``gpus_per_replica``, an mxfp4 group on an
architecture SGLang's mxfp4 loader does not take, a KV dtype SGLang does not take, a group named
after one of the app's functions, :data:`APP_FUNCTIONS`) and warnings
(an undocumented GPU string, an unverified price). Given the model (:func:`deploy.fit.read_model`
of the BF16 checkpoint the fleet serves), it also refuses a group whose GPUs cannot hold the
model's weights in its format plus one full-context sequence of KV cache within SGLang's memory
fraction (:mod:`deploy.fit`), and a checkpoint of another architecture than the preset's.
:func:`build_plan` turns a fleet without errors
into a :class:`DeployPlan` — one :class:`ServerPlan` per group with its GPU, image family, SGLang
argv and autoscaling, plus the router and the weight-conversion function — and raises
:class:`PresetRejected` carrying the problems otherwise. Pure: no modal import, nothing contacted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.errors import UserError
from deploy.fit import Fit, Model, fit, read_model
from fleet.specs import FleetSpec, GroupSpec, load_preset
from images import sglang
from images.accelerators import Family, GpuError, gpu_string, max_count, parse_gpu

APP_NAME = "mixfleet"
# The app's own functions beside the GPU servers. A server is registered under its group's name in
# the same namespace, and modal replaces a function of the same name with only a logged warning
# (modal 1.6.4 ``app.py`` 704-719, ``_App._add_function``), so a group may not take these names.
ROUTER_FUNCTION = "router"
PUBLISH_FUNCTION = "publish"
APP_FUNCTIONS = (ROUTER_FUNCTION, PUBLISH_FUNCTION)
PUBLIC_PORT = 8000  # the sidecar: the port Modal's proxy forwards to
ENGINE_PORT = 30000  # SGLang, reachable only inside the container
VOLUME_NAME = "mixfleet-weights"
VOLUME_MOUNT = "/weights"
STAGE_DIR = "/root/mixfleet-stage"  # the replica's own disk: versions staged from the Volume
STAGED_EXAMPLE = f"{STAGE_DIR}/v<N>"  # where the replica stages version N (weight_sync.stage), as shown
REDIS_SECRET = "mixfleet-redis"  # MIXFLEET_REDIS_URL
KEYS_SECRET = "mixfleet-api-keys"  # MIXFLEET_API_KEYS: the router's keys and scopes
REPLICA_SECRET = "mixfleet-replica-key"  # MIXFLEET_REPLICA_KEY: the sidecars' key (scope replica)
# A Modal Proxy Auth Token (modal.com/docs/guide/webhook-proxy-auth): the GPU servers require it,
# so whatever calls a sidecar (the router) sends its ID and secret as Modal-Key / Modal-Secret.
PROXY_SECRET = "mixfleet-proxy-auth"
PROXY_KEY_ENV = "MIXFLEET_PROXY_KEY"
PROXY_SECRET_ENV = "MIXFLEET_PROXY_SECRET"
REDIS_URL_ENV = "MIXFLEET_REDIS_URL"
REPLICA_KEY_ENV = "MIXFLEET_REPLICA_KEY"
ROUTER_URL_ENV = "MIXFLEET_ROUTER_URL"
CHAT_MODEL_ENV = "MIXFLEET_CHAT_MODEL"  # at deploy: the router's --chat-model, a directory on the Volume
VOCAB_SIZE_ENV = "MIXFLEET_VOCAB_SIZE"  # at deploy: the router's --vocab-size (--checkpoint's config.json)
RUN_ENV = "MIXFLEET_RUN"
# The fleet a container's app is built from (deploy/modal_app.py ships it); where it is set, it
# takes the place of the preset.
FLEET_ENV = "MIXFLEET_FLEET_JSON"
DEFAULT_RUN = "main"
# A replica's start: stage a version from the Volume, load it into SGLang, capture CUDA graphs.
SERVER_STARTUP_TIMEOUT_S = 1800
SERVER_EXIT_GRACE_S = 120  # in-flight turns finish on scale-down (Modal allows up to 3600 for servers)
# Requests a replica takes beyond its sessions: its sidecar's own control and status calls.
CONTROL_HEADROOM = 8


def chat_model_dir(value: str | None) -> str | None:
    """The router's chat model (``mixfleet deploy --chat-model``, ``$MIXFLEET_CHAT_MODEL``): a
    directory on the weights Volume, or None (the chat routes then answer 503). UserError for a
    path outside :data:`VOLUME_MOUNT`, the only place the router's container can read it."""
    if not value:
        return None
    if not value.startswith(VOLUME_MOUNT + "/"):
        raise UserError(
            f"chat model {value!r}: must be a directory on the weights Volume (under {VOLUME_MOUNT}/)"
        )
    return value


def chat_model_line(chat_model: str | None) -> str:
    """The dry-run's line on the chat APIs."""
    if chat_model is None:
        return "chat APIs: off (no --chat-model: the router's chat routes answer 503)"
    return f"chat APIs: rendered with {chat_model} (the router's --chat-model)"


def vocab_line(vocab_size: int | None, chat_model: str | None) -> str:
    """The dry-run's line on the router's vocabulary check (``--vocab-size``, :func:`vocab_size_env`)."""
    if vocab_size is not None:
        return f"vocabulary: the router refuses input ids >= {vocab_size} (--checkpoint's config.json)"
    if chat_model is not None:
        where = f"{chat_model}/config.json"
        return f"vocabulary: the router refuses input ids beyond {where}'s vocab_size, if it names one"
    return "vocabulary: not checked (no --checkpoint or --chat-model: out-of-vocabulary ids reach SGLang)"


def vocab_size_env(value: str | None) -> int | None:
    """The router's ``--vocab-size`` shipped as ``$MIXFLEET_VOCAB_SIZE`` (None when unset);
    UserError for anything but a positive integer."""
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{VOCAB_SIZE_ENV} must be a positive integer, got {value!r}")
    return int(value)


NO_FIT_LINE = "  memory: not checked (--checkpoint DIR: the BF16 checkpoint the fleet serves)"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a preset for Modal; ``group`` is None for the fleet as a whole."""

    level: Literal["error", "warning"]
    message: str
    group: str | None = None

    def line(self) -> str:
        """``<level>: [group G: ]<message>``."""
        return f"{self.level}: {self.text()}"

    def text(self) -> str:
        """The problem without its level: ``[group G: ]<message>``."""
        return f"group {self.group}: {self.message}" if self.group else self.message


class PresetRejected(UserError):
    """The preset cannot be deployed; ``problems`` holds every error and warning found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        errors = [p for p in problems if p.level == "error"]
        super().__init__(f"{len(errors)} problem(s) in the preset:\n" + "\n".join(p.line() for p in problems))


@dataclass(frozen=True)
class Autoscaling:
    """Modal's autoscaler settings of one server (containers = replicas)."""

    min_containers: int
    max_containers: int
    buffer_containers: int
    scaledown_window: int
    target_concurrency: int
    max_concurrency: int


@dataclass(frozen=True)
class ServerPlan:
    """One GPU server: a sampler group's replicas on Modal."""

    group: GroupSpec
    gpu: str
    family: Family
    sglang_argv: tuple[str, ...]
    autoscaling: Autoscaling
    port: int = PUBLIC_PORT

    @property
    def name(self) -> str:
        return self.group.name


@dataclass(frozen=True)
class RouterPlan:
    """The router: an ASGI app on several CPU containers sharing Redis."""

    min_containers: int = 2
    max_containers: int = 8
    target_concurrency: int = 500
    max_concurrency: int = 1000
    scaledown_window: int = 600
    cpu: float = 4.0
    memory_mib: int = 8192


@dataclass(frozen=True)
class ConvertPlan:
    """The CPU function converting a BF16 checkpoint (35B parameters: ~70 GB) into every format."""

    cpu: float = 32.0
    memory_mib: int = 256 * 1024
    ephemeral_disk_mib: int = 512 * 1024
    timeout_s: int = 4 * 3600


@dataclass(frozen=True)
class DeployPlan:
    fleet: FleetSpec
    servers: tuple[ServerPlan, ...]
    router: RouterPlan = field(default_factory=RouterPlan)
    convert: ConvertPlan = field(default_factory=ConvertPlan)
    warnings: tuple[Problem, ...] = ()
    model: Model | None = None  # None: the memory fit was not checked (no checkpoint given)

    @property
    def families(self) -> tuple[Family, ...]:
        return tuple(dict.fromkeys(s.family for s in self.servers))


def _check_group(g: GroupSpec, architecture: str) -> list[Problem]:
    problems: list[Problem] = []

    def add(level: Literal["error", "warning"], message: str) -> None:
        problems.append(Problem(level, message, g.name))

    if g.name in APP_FUNCTIONS:
        add("error", f"the name {g.name!r} is the app's {g.name} function's; a group needs another name")
    if g.is_local:
        add("error", "accelerator 'cpu' is a local group; a Modal server needs a GPU")
    else:
        try:
            gpu = parse_gpu(g.accelerator)
        except GpuError as exc:
            add("error", str(exc))
        else:
            if not gpu.documented:
                add(
                    "warning",
                    f"GPU {gpu.kind!r} is not in Modal's documented GPU list (used by Modal's Stitch)",
                )
            if g.gpus_per_replica > max_count(gpu.kind):
                add(
                    "error",
                    f"gpus_per_replica {g.gpus_per_replica} > {max_count(gpu.kind)}, "
                    f"the most {gpu.kind} GPUs per container",
                )
            if gpu.count is not None and gpu.count != g.gpus_per_replica:
                add(
                    "error",
                    f"accelerator {g.accelerator!r} names {gpu.count} GPU(s) but gpus_per_replica is "
                    f"{g.gpus_per_replica}; give the count as gpus_per_replica only",
                )
    if g.weight_format == "mxfp4" and architecture not in sglang.MXFP4_ARCHITECTURES:
        add(
            "error",
            f"weight_format mxfp4 needs an architecture SGLang {sglang.SGLANG_VERSION}'s mxfp4 loader takes "
            f"({', '.join(sglang.MXFP4_ARCHITECTURES)}), not {architecture}",
        )
    if g.kv_cache_dtype not in sglang.KV_CACHE_DTYPES:
        add("error", f"kv_cache_dtype {g.kv_cache_dtype!r} is not one SGLang {sglang.SGLANG_VERSION} takes")
    if g.replicas:
        add("error", "static replica URLs are for engines run elsewhere; a Modal group has none")
    if g.price_per_gpu_hour > 0 and not g.price_verified:
        add(
            "warning",
            f"price {g.price_per_gpu_hour} USD/GPU-hour is unverified ({g.price_source or 'no source'})",
        )
    return problems


def _check_fit(g: GroupSpec, model: Model) -> list[Problem]:
    """An error when ``g``'s GPUs cannot hold ``model`` (a GPU string that does not parse is
    reported by :func:`_check_group` already)."""
    try:
        f = fit(g, model)
    except GpuError:
        return []
    except UserError as exc:
        return [Problem("error", str(exc), g.name)]
    return [] if f.fits else [Problem("error", f.refusal(), g.name)]


def check(fleet: FleetSpec, model: Model | None = None) -> list[Problem]:
    """Every problem of ``fleet`` for a Modal deployment serving ``model`` (None: the memory fit is
    not checked), in group order (empty: deployable as is)."""
    problems: list[Problem] = []
    if model is not None and fleet.architecture not in model.architectures:
        problems.append(
            Problem(
                "error",
                f"checkpoint {model.directory} is {', '.join(model.architectures) or 'of no architecture'}, "
                f"not the preset's {fleet.architecture}",
            )
        )
    for g in fleet.groups:
        problems += _check_group(g, fleet.architecture)
        if model is not None and not g.is_local:
            problems += _check_fit(g, model)
    return problems


def sglang_argv(g: GroupSpec, model_path: str, weight_version: str | None = None) -> list[str]:
    """The SGLang command line of one of ``g``'s replicas serving ``model_path``."""
    return sglang.server_argv(
        model_path=model_path,
        port=ENGINE_PORT,
        weight_format=g.weight_format,
        kv_cache_dtype=g.kv_cache_dtype,
        tp_size=g.gpus_per_replica,
        weight_version=weight_version,
        engine_args=(*g.route_flags, *g.engine_args),
    )


def _server(g: GroupSpec) -> ServerPlan:
    gpu = parse_gpu(g.accelerator)
    autoscaling = Autoscaling(
        min_containers=g.min_replicas,
        max_containers=g.max_replicas,
        buffer_containers=g.buffer_replicas,
        scaledown_window=g.scaledown_window_s,
        target_concurrency=g.sessions_per_replica,
        max_concurrency=g.sessions_per_replica + CONTROL_HEADROOM,
    )
    return ServerPlan(
        group=g,
        gpu=gpu_string(gpu.kind, g.gpus_per_replica),
        family=gpu.family,
        sglang_argv=tuple(sglang_argv(g, STAGED_EXAMPLE, "<N>")),
        autoscaling=autoscaling,
    )


def build_plan(fleet: FleetSpec, model: Model | None = None) -> DeployPlan:
    """The plan for ``fleet`` serving ``model``; raises :class:`PresetRejected` if :func:`check`
    finds an error."""
    problems = check(fleet, model)
    if any(p.level == "error" for p in problems):
        raise PresetRejected(problems)
    servers = tuple(_server(g) for g in fleet.groups)
    return DeployPlan(fleet=fleet, servers=servers, warnings=tuple(problems), model=model)


def load_plan(preset: str, checkpoint: str | None = None) -> DeployPlan:
    """:func:`build_plan` of a built-in preset name or a TOML path, serving the BF16 checkpoint
    directory ``checkpoint`` (None: the memory fit is not checked); UserError for any failing."""
    fleet = load_preset(preset)
    model = read_model(Path(checkpoint), fleet.formats) if checkpoint is not None else None
    return build_plan(fleet, model)


def fit_of(plan: DeployPlan, server: ServerPlan) -> Fit | None:
    """The memory fit of one server of ``plan`` (None when the plan has no model)."""
    return fit(server.group, plan.model) if plan.model is not None else None


def describe(plan: DeployPlan) -> str:
    """The dry-run text: every server with GPU, format, KV dtype, SGLang argv, autoscaling and
    memory fit (or that it was not checked)."""
    import shlex

    lines = [
        f"app {APP_NAME}: preset {plan.fleet.name} ({plan.fleet.architecture}), {len(plan.servers)} server(s)"
    ]
    for s in plan.servers:
        a = s.autoscaling
        lines += [
            f"server {s.name}: gpu {s.gpu} ({s.family} image {sglang.image_ref()}), "
            f"weights {s.group.weight_format}, kv {s.group.kv_cache_dtype}, port {s.port}, proxy auth on",
            f"  volume {VOLUME_NAME} at {VOLUME_MOUNT}, key from secret {REPLICA_SECRET}",
            f"  autoscaling: min {a.min_containers}, max {a.max_containers}, buffer {a.buffer_containers}, "
            f"scaledown {a.scaledown_window}s, target concurrency {a.target_concurrency}, "
            f"max concurrency {a.max_concurrency}",
            f"  sglang: {shlex.join(s.sglang_argv)}",
        ]
        f = fit_of(plan, s)
        lines.append(f"  {f.summary()}" if f else NO_FIT_LINE)
    r, c = plan.router, plan.convert
    lines += [
        f"router: asgi app, containers {r.min_containers}..{r.max_containers}, target concurrency "
        f"{r.target_concurrency}, redis from secret {REDIS_SECRET}, keys from secret {KEYS_SECRET}, "
        f"proxy auth token from secret {PROXY_SECRET}",
        f"convert: cpu {c.cpu:g}, memory {c.memory_mib} MiB, disk {c.ephemeral_disk_mib} MiB, "
        f"timeout {c.timeout_s}s, volume {VOLUME_NAME} at {VOLUME_MOUNT}",
    ]
    lines += [p.line() for p in plan.warnings]
    return "\n".join(lines)
