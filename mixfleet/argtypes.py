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
