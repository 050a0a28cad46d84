"""The production fleet on Modal: ``modal deploy deploy/modal_app.py`` (preset from ``MIXFLEET_PRESET``,
default ``mixed``; run id from ``MIXFLEET_RUN``, default ``main``; the router's chat model from
``MIXFLEET_CHAT_MODEL``, a checkpoint directory on the weights Volume, default none; its
vocabulary size from ``MIXFLEET_VOCAB_SIZE``, set by ``mixfleet deploy --checkpoint``).

Defines, from the :mod:`deploy.plan` of the preset (which refuses a bad preset before any object
is created):

- one GPU server per sampler group (``@app.server``): the group's GPU string and count, the image
  of its accelerator family, proxy auth on, the sidecar's key from the ``mixfleet-replica-key``
  secret, the sidecar on the public port, target and maximum
  concurrency from ``sessions_per_replica``, min/max/buffer containers and the scale-down window
  from the preset. Its ``@modal.enter`` starts the replica entrypoint ``replica.entrypoint.run_replica``
  (stage the current version from the Volume to local disk, SGLang on a private port, the
  sidecar on the public one) with :func:`replica_kwargs`.
- ``router``: the router as an ASGI app on several containers, built by the router's own factory
  (:func:`mixfleet.router.app_from_args`, what every ``mixfleet router`` worker runs): state in Redis
  (URL from the ``mixfleet-redis`` secret), API keys from the ``mixfleet-api-keys`` secret, the
  proxy auth token it reaches the servers with (``Modal-Key`` / ``Modal-Secret`` on every call to
  a replica) from ``mixfleet-proxy-auth``, the weight store on the Volume, and its publications
  run by the ``publish`` function (``MIXFLEET_CONVERT_FUNCTION``), and, when the deploy named
  one, the chat model its per-session chat APIs render with (``--chat-model``: a directory under
  ``/weights`` holding the served model's ``tokenizer.json`` and ``tokenizer_config.json``, e.g. a
  published version's). Its URL is public (no proxy
  auth: trainers and agents authenticate with the router's own bearer keys).
- ``publish``: a CPU function with the weights Volume mounted that converts a BF16 checkpoint once
  per format and publishes it as a version (the local converter of
  :mod:`weight_sync.converters`, run in this function's container).

Replicas of one server: every container of a group's server has the server's one URL and
heartbeats with its own replica id (``<group>-<MODAL_TASK_ID>``), so the router's registry holds
one entry per container, all with that URL. The router runs with ``modal_app`` set to this app
(:func:`router_args`): it lists each server's containers (``Server._experimental_list_containers``,
behind :mod:`router.pinning.modal_server`) and pins every request to the replica it chose with
``modal-flash-upstream: <host>:<port>``, so failover reaches another container and the recorded
replica is where a turn ran (``Modal-Session-ID`` still goes with every turn).

A container is registered to serve as soon as its ``@modal.enter`` returns (modal 1.6.4
``_runtime/user_code_imports.py`` 370-376: the enter methods run, then ``_FlashContainerEntry.enter``,
which for a server calls ``server_forward``, ``experimental/_flash_container_entry.py`` 40-41, and
that sends ``ContainerServerLifecycleReady``, ``experimental/flash_server.py`` 19-21), so ``@enter``
returns only once the sidecar is ready and its engine serves the store's current version
(:meth:`deploy.replica_thread.ReplicaThread.wait_ready`).

The servers' parameters are the keyword arguments in :data:`SERVER_OPTIONS` (what ``@app.server``
received, for inspection: the client's ``Function.info()`` holds no autoscaler settings).
Importing this module contacts nothing; the fleet spec travels to the containers in the
``MIXFLEET_FLEET_JSON`` environment variable, so a container builds the same app without the file.
"""

from __future__ import annotations

import os
import threading
from functools import partial
from pathlib import Path
from typing import Any

import modal

from deploy import plan as deploy_plan
from deploy.plan import (
    APP_NAME,
    CHAT_MODEL_ENV,
    DEFAULT_RUN,
    ENGINE_PORT,
    FLEET_ENV,
    KEYS_SECRET,
    PROXY_KEY_ENV,
    PROXY_SECRET,
    PROXY_SECRET_ENV,
    PUBLISH_FUNCTION,
    REDIS_SECRET,
    REDIS_URL_ENV,
    REPLICA_KEY_ENV,
    REPLICA_SECRET,
    ROUTER_FUNCTION,
    ROUTER_URL_ENV,
    RUN_ENV,
    SERVER_EXIT_GRACE_S,
    SERVER_STARTUP_TIMEOUT_S,
    STAGE_DIR,
    VOCAB_SIZE_ENV,
    VOLUME_MOUNT,
    VOLUME_NAME,
    ServerPlan,
)
from deploy.replica_thread import ReplicaThread
from fleet.specs import FleetSpec, GroupSpec, load_preset
from images import sglang
from images.modal_images import cpu_image, sglang_image
from weight_sync.converters import CONVERT_FUNCTION_ENV
from weight_sync.store import StoreLocation
from weight_sync.store.modal_volume import VOLUME_FS_VERSION, ModalVolumeStore

PRESET_ENV = "MIXFLEET_PRESET"
STORE_ENV = "MIXFLEET_STORE"
STORE_VOLUME_ENV = "MIXFLEET_STORE_VOLUME"  # router.publishing: the store is this Volume at MIXFLEET_STORE
TASK_ID_ENV = "MODAL_TASK_ID"  # set by Modal in every container: "The ID of the container" (docs, env vars)
STORE_SCRATCH = "/root/mixfleet-scratch"  # the store's staging and lock, on the container's own disk
REPLICA_STOP_GRACE_S = 30  # SIGTERM to SIGKILL for the engine and sidecar at scale-down


def _fleet() -> FleetSpec:
    """The fleet a container was deployed with, else the preset ``MIXFLEET_PRESET`` names."""
    shipped = os.environ.get(FLEET_ENV)
    if shipped:
        return FleetSpec.model_validate_json(shipped)
    return load_preset(os.environ.get(PRESET_ENV) or "mixed")


PLAN = deploy_plan.build_plan(_fleet())
RUN_ID = os.environ.get(RUN_ENV) or DEFAULT_RUN
ENV = {FLEET_ENV: PLAN.fleet.model_dump_json(), RUN_ENV: RUN_ID, STORE_ENV: VOLUME_MOUNT}
if sglang.image_digest():  # a container builds the same image reference as the deploy did
    ENV[sglang.IMAGE_DIGEST_ENV] = sglang.image_digest()
ROUTER_ENV = {**ENV, STORE_VOLUME_ENV: VOLUME_NAME, CONVERT_FUNCTION_ENV: f"{APP_NAME}/{PUBLISH_FUNCTION}"}
CHAT_MODEL = deploy_plan.chat_model_dir(os.environ.get(CHAT_MODEL_ENV))
if CHAT_MODEL is not None:
    ROUTER_ENV[CHAT_MODEL_ENV] = CHAT_MODEL
VOCAB_SIZE = deploy_plan.vocab_size_env(os.environ.get(VOCAB_SIZE_ENV))
if VOCAB_SIZE is not None:
    ROUTER_ENV[VOCAB_SIZE_ENV] = str(VOCAB_SIZE)

app = modal.App(APP_NAME)
volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True, version=VOLUME_FS_VERSION)
redis_secret = modal.Secret.from_name(REDIS_SECRET, required_keys=[REDIS_URL_ENV])
keys_secret = modal.Secret.from_name(KEYS_SECRET, required_keys=["MIXFLEET_API_KEYS"])
replica_secret = modal.Secret.from_name(REPLICA_SECRET, required_keys=[REPLICA_KEY_ENV])
proxy_secret = modal.Secret.from_name(PROXY_SECRET, required_keys=[PROXY_KEY_ENV, PROXY_SECRET_ENV])


STORE = StoreLocation(root=Path(VOLUME_MOUNT), volume=VOLUME_NAME, scratch=Path(STORE_SCRATCH))


def _volume_store() -> ModalVolumeStore:
    """The version store on the Volume mounted at ``/weights`` (scratch on the container's disk)."""
    store = STORE.open()
    assert isinstance(store, ModalVolumeStore)
    return store


def _router_url() -> str:
    """The router's URL: ``MIXFLEET_ROUTER_URL`` when set, else the deployed router function's."""
    url = os.environ.get(ROUTER_URL_ENV)
    if url:
        return url
    found = modal.Function.from_name(APP_NAME, ROUTER_FUNCTION).get_web_url()
    if not found:
        raise RuntimeError(f"the {APP_NAME} app has no {ROUTER_FUNCTION} URL; set {ROUTER_URL_ENV}")
    return found


def replica_id(group: GroupSpec) -> str | None:
    """This container's replica id, ``<group>-<MODAL_TASK_ID>`` (None outside a Modal container:
    the entrypoint's default then names the host): unique per container, while every container
    of the server shares its one URL."""
    task = os.environ.get(TASK_ID_ENV)
    return f"{group.name}-{task}" if task else None


def replica_kwargs(group: GroupSpec, stop: threading.Event, router_url: str, public_url: str | None) -> dict:
    """The keyword arguments of ``replica.entrypoint.run_replica`` for one replica of ``group``: the
    store on the Volume, staging on the container's disk, SGLang of the pinned release on the
    private engine port, the sidecar on the public port, the replica key from its secret, the
    container's own replica id (:func:`replica_id`)."""

    def engine_argv(model_path: str, weight_version: str | None) -> list[str]:
        return deploy_plan.sglang_argv(group, model_path, weight_version)

    return {
        "group": group,
        "run_id": RUN_ID,
        "store": STORE,
        "stage_dir": STAGE_DIR,
        "engine_argv": engine_argv,
        "engine_port": ENGINE_PORT,
        "public_port": deploy_plan.PUBLIC_PORT,
        "router_url": router_url,
        "replica_key": os.environ.get(REPLICA_KEY_ENV),
        "public_url": public_url,
        "replica_id": replica_id(group),
        "stop": stop,
        "ready_timeout_s": float(SERVER_STARTUP_TIMEOUT_S),
        "grace_s": float(REPLICA_STOP_GRACE_S),
    }


def _start_replica(group: GroupSpec, stop: threading.Event) -> None:
    """Run one replica of ``group`` with the replica entrypoint until ``stop`` is set (blocks)."""
    from replica.entrypoint import run_replica

    public_url = modal.Server.from_name(APP_NAME, group.name).get_url()
    run_replica(**replica_kwargs(group, stop, _router_url(), public_url))


def server_options(s: ServerPlan) -> dict[str, Any]:
    """The keyword arguments ``@app.server`` receives for ``s``."""
    a = s.autoscaling
    return {
        "name": s.name,
        "image": sglang_image(s.family),
        "gpu": s.gpu,
        "port": s.port,
        "unauthenticated": False,
        "target_concurrency": a.target_concurrency,
        "max_concurrency": a.max_concurrency,
        "min_containers": a.min_containers,
        "max_containers": a.max_containers,
        "buffer_containers": a.buffer_containers,
        "scaledown_window": a.scaledown_window,
        "startup_timeout": SERVER_STARTUP_TIMEOUT_S,
        "exit_grace_period": SERVER_EXIT_GRACE_S,
        "volumes": {VOLUME_MOUNT: volume},
        "secrets": [replica_secret],
        "env": ENV,
    }


def _define_server(s: ServerPlan) -> modal.Server:
    """Register ``s`` as a server whose class is a global of this module (Modal finds it by name).

    Its ``@modal.enter`` returns once the sidecar is ready and its engine serves the store's
    current version (:meth:`ReplicaThread.wait_ready`: Modal registers the container to serve when
    it returns) and fails the container as soon as the replica entrypoint ends before that;
    ``@modal.exit`` stops it.
    """
    group = s.group

    def start(self) -> None:
        self.replica = ReplicaThread(partial(_start_replica, group), name=f"replica-{group.name}").start()
        self.replica.wait_ready(s.port, SERVER_STARTUP_TIMEOUT_S)

    def stop(self) -> None:
        self.replica.stop(SERVER_EXIT_GRACE_S)

    cls_name = "Server_" + s.name.replace("-", "_")
    cls = type(
        cls_name, (), {"__module__": __name__, "start": modal.enter()(start), "stop": modal.exit()(stop)}
    )
    server = app.server(**server_options(s))(cls)
    globals()[cls_name] = server
    return server


SERVER_OPTIONS: dict[str, dict[str, Any]] = {s.name: server_options(s) for s in PLAN.servers}
SERVERS: dict[str, modal.Server] = {s.name: _define_server(s) for s in PLAN.servers}


@app.function(
    name=ROUTER_FUNCTION,
    image=cpu_image(),
    cpu=PLAN.router.cpu,
    memory=PLAN.router.memory_mib,
    min_containers=PLAN.router.min_containers,
    max_containers=PLAN.router.max_containers,
    scaledown_window=PLAN.router.scaledown_window,
    volumes={VOLUME_MOUNT: volume},
    secrets=[redis_secret, keys_secret, proxy_secret],
    env=ROUTER_ENV,
    timeout=24 * 3600,
)
@modal.concurrent(max_inputs=PLAN.router.max_concurrency, target_inputs=PLAN.router.target_concurrency)
@modal.asgi_app()
def router() -> Any:
    """The router app over Redis state for this fleet: :func:`mixfleet.router.app_from_args` of
    :func:`router_args` (keys from ``MIXFLEET_API_KEYS``, proxy auth from ``MIXFLEET_PROXY_KEY`` /
    ``MIXFLEET_PROXY_SECRET``, the store and converter from :data:`ROUTER_ENV`)."""
    from mixfleet.router import app_from_args

    return app_from_args(router_args())


# Versions of the run the weights Volume keeps (the router's --keep-store-versions): as many as
# the ledger and mismatch sums keep in detail (--keep-versions); at the study's tens of GB per
# format and version, the Volume holds about (16 + delta bases) x formats x that.
STORE_VERSIONS_KEPT = 16


def router_args() -> dict[str, Any]:
    """The router's arguments in this container: ``mixfleet router``'s defaults with this fleet
    (shipped as JSON), the Redis state of ``MIXFLEET_REDIS_URL``, requests pinned to the
    containers of this app's servers, the deploy's chat model (:data:`CHAT_MODEL`), the served
    checkpoint's vocabulary size (:data:`VOCAB_SIZE`, ``mixfleet deploy --checkpoint``'s; None:
    the chat model's, :func:`mixfleet.router.vocab_value`) and the store pruned to
    :data:`STORE_VERSIONS_KEPT` versions."""
    from mixfleet.router import default_args

    return default_args(
        fleet_json=PLAN.fleet.model_dump_json(),
        state=os.environ[REDIS_URL_ENV],
        modal_app=APP_NAME,
        chat_model=CHAT_MODEL,
        vocab_size=VOCAB_SIZE,
        keep_store_versions=STORE_VERSIONS_KEPT,
    )


@app.function(
    name=PUBLISH_FUNCTION,
    image=cpu_image(),
    cpu=PLAN.convert.cpu,
    memory=PLAN.convert.memory_mib,
    ephemeral_disk=PLAN.convert.ephemeral_disk_mib,
    timeout=PLAN.convert.timeout_s,
    volumes={VOLUME_MOUNT: volume},
    env=ENV,
)
def publish(
    checkpoint: str,
    version: int,
    formats: str = "",
    run_id: str = "",
    mode: str = "barrier",
    delta_of: int | None = None,
) -> dict[str, Any]:
    """Convert the BF16 checkpoint at ``checkpoint`` (a path on the Volume) once per format
    (``formats`` comma-separated; default the fleet's) and publish it as ``version`` of ``run_id``
    (default this deployment's run); with ``delta_of`` B the checkpoint holds only the tensors
    changed since B. Returns the publish result as JSON data. The router's
    :class:`~weight_sync.converters.ModalFunctionConverter` calls it with
    :func:`~weight_sync.converters.modal_function.call_kwargs`."""
    store = _volume_store()
    store.refresh()  # the checkpoint the trainer committed to the Volume becomes visible here
    return publish_into(store, checkpoint, version, formats, run_id, mode, delta_of)


def publish_into(
    store: Any, checkpoint: str, version: int, formats: str, run_id: str, mode: str, delta_of: int | None
) -> dict[str, Any]:
    """:func:`publish`'s work on ``store`` (:func:`weight_sync.converters.modal_function.run_request`
    with this deployment's defaults)."""
    from weight_sync.converters.modal_function import run_request

    kwargs = {
        "checkpoint": checkpoint,
        "version": version,
        "formats": formats or ",".join(PLAN.fleet.formats),
        "run_id": run_id or RUN_ID,
        "mode": mode,
        "delta_of": delta_of,
    }
    return run_request(store, kwargs)
