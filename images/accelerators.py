"""Modal GPU strings and the accelerator family (hence the image) each one runs.

The modal client does not validate GPU strings (any string passes offline), so this is the check.
``DOCUMENTED`` is the list in Modal's GPU guide (modal.com/docs/guide/gpu, "Specifying GPU type");
``B300`` is used by Modal's own RL control plane (modal-projects/stitch,
``cookbook/common/config.py`` ``GPUType``) but is not documented, so it is allowed with a warning.
A string may end in ``:N`` (N GPUs); the same guide allows up to 8 per container (4 for A10).
:func:`memory_mib` is one GPU's memory as SGLang sizes its pools from it (see ``MEMORY_MIB``).
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
# One GPU's memory in MiB as ``nvidia-smi --query-gpu=memory.total`` reports it: the figure SGLang
# 0.5.23 sizes its static memory from (utils/common.py 802-832, get_nvgpu_memory_capacity). These
# are the values the driver reports for each board (NVIDIA's datasheet figure in GB in the comment;
# the driver reserves part of it); none was measured from here (no GPU). Where Modal may hand out a
# bigger GPU than the one asked for ("A100" may be an 80 GB one, "H100" an H200, "B200+" a B300;
# Modal's GPU guide, "GPU fallbacks" and stitch config.py), the figure is the smallest it may be.
MEMORY_MIB: dict[str, int] = {
    "T4": 15360,  # 16 GB GDDR6
    "L4": 23034,  # 24 GB GDDR6
    "A10": 23028,  # 24 GB GDDR6 (A10G)
    "L40S": 46068,  # 48 GB GDDR6
    "A100": 40960,  # 40 GB HBM2 (or an 80 GB A100)
    "A100-40GB": 40960,  # 40 GB HBM2
    "A100-80GB": 81920,  # 80 GB HBM2e
    "RTX-PRO-6000": 97887,  # 96 GB GDDR7 (RTX PRO 6000 Blackwell Server Edition)
    "H100": 81559,  # 80 GB HBM3 (or an H200)
    "H100!": 81559,  # 80 GB HBM3
    "H200": 143771,  # 141 GB HBM3e
    "B200": 183359,  # 180 GB HBM3e per GPU in HGX B200 (192 GB on the package)
    "B200+": 183359,  # a B200 or a B300: the B200's
    "B300": 274658,  # 288 GB HBM3e per GPU in HGX B300: 288e9 bytes, no driver figure read
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


MAX_COUNT = {"A10": 4}  # every other type: 8


def max_count(kind: str) -> int:
    """The most GPUs of ``kind`` one container can have."""
    return MAX_COUNT.get(kind, 8)


def parse_gpu(value: str) -> Gpu:
    """Parse ``TYPE`` or ``TYPE:N``; raises :class:`GpuError` for a type neither documented nor
    known-undocumented (naming the spelling when only the case differs), or a count that is not
    an integer in 1..the type's maximum."""
    kind, sep, count_text = value.partition(":")
    if kind not in _FAMILY:
        spelled = next((k for k in _FAMILY if k.lower() == kind.lower()), None)
        hint = f"; write it as {spelled!r}" if spelled else f" (documented: {', '.join(DOCUMENTED)})"
        raise GpuError(value, f"GPU {value!r} is not a Modal GPU type{hint}")
    count: int | None = None
    if sep:
        if not count_text.isdigit() or not 1 <= int(count_text) <= max_count(kind):
            raise GpuError(
                value, f"GPU {value!r}: the count after ':' must be an integer in 1..{max_count(kind)}"
            )
        count = int(count_text)
    return Gpu(kind=kind, count=count, documented=kind in DOCUMENTED)


def memory_mib(kind: str) -> int:
    """One ``kind`` GPU's memory in MiB as the driver reports it (``MEMORY_MIB``)."""
    return MEMORY_MIB[kind]


def gpu_string(kind: str, count: int) -> str:
    """The string Modal takes for ``count`` GPUs of ``kind`` (``H100!:2``; just the kind for one)."""
    return kind if count == 1 else f"{kind}:{count}"
