"""The knobs of a demo run (:func:`trainer.demo.run_demo`), checked on construction; this module
imports no torch, so a command line can take its defaults cheaply."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.methods import METHODS
from trainer.tasks import ReverseDigits


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of a demo run (recorded in ``demo.json``); a knob no run can use is a ValueError
    naming it, before anything starts."""

    method: str = "sc-mis-topp"
    seed: int = 0
    min_len: int = 3
    max_len: int = 4
    partial_credit: bool = True
    turns: int = 2  # answers per episode at most (the agent may answer again after feedback)
    sft_steps: int = 40
    sft_batch: int = 64
    sft_lr: float = 3e-3
    updates: int = 1000
    time_limit_s: float = 600.0
    prompts: int = 32
    samples: int = 8
    agents: int = 32
    outstanding: int = 256
    lr: float = 1e-3
    max_version_age: int | None = 2
    temperature: float = 1.0
    top_p: float = 0.95
    band: tuple[float, float] | None = None  # None: the MIS band of trainer.corrections
    trainer_threads: int = 2
    activation_timeout_s: float = 120.0
    job_wait_s: float = 600.0  # how long a publish waits for another weight job to end
    keep: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in (
            "sft_batch",
            "updates",
            "prompts",
            "samples",
            "agents",
            "outstanding",
            "trainer_threads",
            "keep",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sft_steps < 0:
            raise ValueError(f"sft_steps must be >= 0, got {self.sft_steps}")
        for name in ("lr", "sft_lr"):  # checked here, not by the optimizer after the warm start
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive, finite number, got {getattr(self, name)}")
        if self.max_version_age is not None and self.max_version_age < 0:
            raise ValueError(f"max_version_age must be >= 0 (or None: unbounded), got {self.max_version_age}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        self.task()

    def task(self) -> ReverseDigits:
        """The task these knobs describe (ValueError naming a bad one)."""
        return ReverseDigits(self.min_len, self.max_len, self.partial_credit, self.turns)

    @property
    def batch_size(self) -> int:
        return self.prompts * self.samples
