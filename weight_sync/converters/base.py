"""The converter port: where a publication's conversion runs.

A :class:`Converter` takes a :class:`ConvertRequest` (one BF16 checkpoint, one version, the
formats to publish) and runs the publish protocol of :mod:`weight_sync.publish` on it against a
store: on return every requested format's pointer names the version (or it raised, and the
protocol's guarantees hold: no pointer names an incomplete version). Adapters differ only in
*where* the protocol runs: in this process's conversion pool (:mod:`.local`) or in a Modal CPU
function with the store's Volume mounted (:mod:`.modal_function`), which itself runs the local
adapter. The publish protocol exists once, in :mod:`weight_sync.publish`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from core.errors import UserError
from weight_sync.publish import Event, no_events
from weight_sync.store.base import VersionStore


@dataclass(frozen=True)
class ConvertRequest:
    """One publication: ``checkpoint`` (an absolute path readable where the conversion runs)
    published as ``version`` of ``run_id`` in ``formats``, in ``mode`` (``barrier`` |
    ``per_format``). With ``delta_of`` B the directory holds only the BF16 tensors changed since
    B and every format is published as a delta over B (:func:`weight_sync.publish.publish_delta`).
    """

    run_id: str
    version: int
    checkpoint: str
    formats: tuple[str, ...]
    mode: str = "barrier"
    delta_of: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (what crosses a process or a Modal call)."""
        return {**asdict(self), "formats": list(self.formats)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConvertRequest:
        """The request of :meth:`to_json`'s data; :class:`UserError` naming a missing or
        ill-typed field."""
        if not isinstance(data, Mapping):
            raise UserError(f"a convert request is a JSON object, got {type(data).__name__}")
        fields = {
            "run_id": str,
            "version": int,
            "checkpoint": str,
            "formats": list,
            "mode": str,
            "delta_of": (int, type(None)),
        }
        unknown = set(data) - set(fields)
        if unknown:
            raise UserError(f"convert request: unknown fields {sorted(unknown)}")
        for name, kind in fields.items():
            if name not in data and name not in ("mode", "delta_of"):
                raise UserError(f"convert request: {name} is required")
            value = data.get(name)
            if name in data and (not isinstance(value, kind) or isinstance(value, bool)):
                raise UserError(f"convert request: {name} has the wrong type ({type(value).__name__})")
        if not all(isinstance(f, str) for f in data["formats"]):
            raise UserError("convert request: formats must be a list of format names")
        return cls(
            run_id=data["run_id"],
            version=data["version"],
            checkpoint=data["checkpoint"],
            formats=tuple(data["formats"]),
            mode=data.get("mode", "barrier"),
            delta_of=data.get("delta_of"),
        )


class Converter(ABC):
    """Runs publications (see the module docstring). ``start`` may prepare workers ahead of the
    first publication; ``close`` releases whatever the converter holds (idempotent; after it no
    worker process of the converter is left)."""

    name: str = "converter"

    @abstractmethod
    def publish(
        self, store: VersionStore, request: ConvertRequest, on_event: Event = no_events
    ) -> dict[str, Any]:
        """Run ``request`` against ``store`` (blocking) and return the publication's result as
        JSON data (:meth:`weight_sync.publish.PublishResult.to_dict`, with at least ``version``);
        raises :class:`UserError` for bad input."""

    def start(self, formats: int) -> None:  # noqa: B027 - optional hook
        """Prepare for publications of ``formats`` formats (default: nothing to prepare)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the converter holds (default: nothing)."""


__all__ = ["ConvertRequest", "Converter", "Event"]
