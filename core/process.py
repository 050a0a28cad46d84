"""A process: whether one exists, by its pid, and the open-file limit of a server process (the
one place each is asked or set)."""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0): a zombie, dead but not reaped, does; so does
    someone else's process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


OPEN_FILES_TARGET = 65535
"""The soft open-file limit a server process asks for: SGLang 0.5.23's own, which its engine sets
at launch (``set_ulimit(target_soft_limit=65535)``, python/sglang/srt/utils/common.py 2585-2594,
called from entrypoints/engine.py 1945 ``_set_envs_and_config``)."""

OPEN_FILES_LOW = 4096
"""A soft open-file limit below this is logged at warning: a router's engine pool alone may hold
1,024 connections (``clients/engine.py`` ``make_http_client``), beside a client connection per
agent session and its Redis connections."""


def open_files_wanted(hard: int) -> int:
    """The soft open-file limit :func:`raise_open_file_limit` raises to under the hard limit
    ``hard``: :data:`OPEN_FILES_TARGET`, or ``hard`` where that is lower."""
    return OPEN_FILES_TARGET if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_TARGET)


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to :func:`open_files_wanted` (:data:`OPEN_FILES_TARGET`,
    or the hard limit where that is lower); a limit already that high is left as it is. Returns
    the soft limit in force after.

    Every socket is a file descriptor: a server that holds a client connection per agent session,
    its pooled engine connections and its Redis connections passes 1,024 (the usual default soft
    limit, while the hard one is far higher) at about 1,000 sessions, and past the soft limit
    every ``accept`` fails with EMFILE and the connection is dropped. Every long-running server
    of mixfleet calls this at start: each router process (every worker of ``--workers N``, the
    router on Modal), the sidecar and the local engine; so does a launcher before it starts a
    process (:func:`launcher.children.spawn`), which the process inherits. A refusal, or a limit left below
    :data:`OPEN_FILES_LOW` (a low hard limit), is logged at warning, one line, and the process goes
    on with the limit it has: this never fails start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    target = open_files_wanted(hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit %d to %d (%s): %s", soft, target, exc, _ADVICE)
            return soft
        soft = target
    if soft < OPEN_FILES_LOW:
        log.warning("the open-file limit is %d (hard limit %d): %s", soft, hard, _ADVICE)
    return soft


_ADVICE = (
    "connections beyond it are refused (EMFILE, 'Too many open files'); raise the hard limit "
    "(ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)"
)
