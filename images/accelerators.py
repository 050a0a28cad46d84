"""Modal GPU strings and the accelerator family (hence the image) each one runs.

The modal client does not validate GPU strings (any string passes offline), so this is the check.
``DOCUMENTED`` is the list in Modal's GPU guide (modal.com/docs/guide/gpu); ``B300`` is used by
Modal's own RL control plane (modal-projects/stitch, ``cookbook/common/config.py`` ``GPUType``) but
is not documented, so it is allowed with a warning. A string may end in ``:N`` (N GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["ampere-hopper", "blackwell"]

DOCUMENTED = (
    "T4", "L4", "A10", "L40S", "A100", "A100-40GB", "A100-80GB", "RTX-PRO-6000", "H100", "H100!",
    "H200", "B200", "B200+",
)  # fmt: skip
UNDOCUMENTED = ("B300",)

# CUDA compute capability of each type: sm_75 Turing, sm_80/86 Ampere, sm_89 Ada, sm_90 Hopper,
# sm_100/103 Blackwell data-centre, sm_120 Blackwell workstation (RTX PRO 6000).
# "B200+" is Modal's floor "B200 or better" (stitch config.py), so B200 or B300.
_FAMILY: dict[str, Family] = {
    "T4": "ampere-hopper",
    "L4": "ampere-hopper",
    "A10": "ampere-hopper",
    "L40S": "ampere-hopper",
    "A100": "ampere-hopper",
    "A100-40GB": "ampere-hopper",
    "A100-80GB": "ampere-hopper",
    "H100": "ampere-hopper",
    "H100!": "ampere-hopper",
    "H200": "ampere-hopper",
    "RTX-PRO-6000": "blackwell",
    "B200": "blackwell",
    "B200+": "blackwell",
    "B300": "blackwell",
}
# Compute capabilities each family's image builds JIT kernels for (TORCH_CUDA_ARCH_LIST syntax).
ARCH_LIST: dict[Family, str] = {
    "ampere-hopper": "7.5;8.0;8.6;8.9;9.0",
    "blackwell": "10.0;10.3;12.0",
}


@dataclass(frozen=True)
class Gpu:
    """A parsed Modal GPU string: its type, the count it names (None: none given), documented or not."""

    kind: str
    count: int | None
    documented: bool

    @property
    def family(self) -> Family:
        return _FAMILY[self.kind]


class GpuError(ValueError):
    """A GPU string Modal does not know; ``value`` is the string as given."""

    def __init__(self, value: str, reason: str) -> None:
        super().__init__(reason)
        self.value = value


def parse_gpu(value: str) -> Gpu:
    """Parse ``TYPE`` or ``TYPE:N``; raises :class:`GpuError` for a type neither documented nor
    known-undocumented, or a count that is not a positive integer."""
    kind, sep, count_text = value.partition(":")
    if kind not in _FAMILY:
        raise GpuError(value, f"GPU {value!r} is not a Modal GPU type (documented: {', '.join(DOCUMENTED)})")
    count: int | None = None
    if sep:
        if not count_text.isdigit() or int(count_text) < 1:
            raise GpuError(value, f"GPU {value!r}: the count after ':' must be a positive integer")
        count = int(count_text)
    return Gpu(kind=kind, count=count, documented=kind in DOCUMENTED)


def gpu_string(kind: str, count: int) -> str:
    """The string Modal takes for ``count`` GPUs of ``kind`` (``H100!:2``; just the kind for one)."""
    return kind if count == 1 else f"{kind}:{count}"
