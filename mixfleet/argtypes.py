"""Argument types the commands share (argparse ``type=``): a value argparse refuses is one line
naming its flag (``mixfleet report: error: argument --timeout: ...``), before the command runs."""

from __future__ import annotations

import argparse
import math


def seconds(text: str) -> float:
    """A positive, finite number of seconds (a wait, a timeout): not 0, negative, NaN or inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def processes(text: str) -> int:
    """A number of processes to start: a whole number, 0 or more (0: the work runs in this one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (convert in this process) or more, got {text!r}")
    return value


def port_range(text: str) -> range:
    """TCP ports ``FIRST-LAST`` (inclusive): whole numbers with ``1 <= FIRST <= LAST <= 65535``."""
    first, sep, last = text.partition("-")
    try:
        ports = range(int(first), int(last) + 1) if sep else None
    except ValueError:
        ports = None
    if ports is None or not 1 <= ports.start < ports.stop <= 65536:
        raise argparse.ArgumentTypeError(f"must be FIRST-LAST with 1 <= FIRST <= LAST <= 65535, got {text!r}")
    return ports


def tcp_port(text: str) -> int:
    """A TCP port: a whole number in 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {text!r}")
    return value


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""uvicorn's log levels (``uvicorn.config.LOG_LEVELS``), which the services' own logging takes too."""


def log_level(text: str) -> str:
    """One of :data:`LOG_LEVELS`, in any case."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()
