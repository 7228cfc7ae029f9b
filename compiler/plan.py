"""Plan: what the user asks of the compiler. A small frozen dataclass, validated on construction.

Only what meshc implements today has a field; asking for something it cannot do yet is an error at
construction, never a silently ignored setting.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to parallelize one model.

    Fields:
        bucket_mb: gradient buckets for the data-parallel all-reduce, in MiB. Parameters are grouped in
            the order the forward first uses them; each bucket is reduced as one flat tensor as soon as
            backward has produced all of its gradients.
        disable: names of passes to switch off (see `meshc.compiler.driver.PASS_NAMES`); for debugging.
        debug_dir: if set, the driver writes each pass's graph before and after into this folder.
        verify: check the compiler's invariants after every pass (tests turn this on).
        trace: "auto" tries strict torch.export (TorchDynamo) and falls back to non-strict; "strict" or
            "non-strict" forces one (non-strict is several times faster on Hugging Face models).
    """

    bucket_mb: float = 25.0
    disable: tuple[str, ...] = field(default=())
    debug_dir: str | None = None
    verify: bool = False
    trace: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_mb, (int, float)) or self.bucket_mb <= 0:
            raise ValueError(f"Plan.bucket_mb: expected a positive number of MiB, got {self.bucket_mb!r}")
        if isinstance(self.disable, str) or not all(isinstance(n, str) for n in self.disable):
            raise TypeError(
                f"Plan.disable: expected a tuple of pass names, got {self.disable!r}; "
                f"write disable=({self.disable!r},) for one pass"
            )
        object.__setattr__(self, "disable", tuple(self.disable))
        if self.trace not in ("auto", "strict", "non-strict"):
            raise ValueError(f"Plan.trace: expected 'auto', 'strict' or 'non-strict', got {self.trace!r}")

    def describe(self) -> str:
        """One line with the fields that differ from their defaults."""
        default = Plan()
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if getattr(self, f.name) != getattr(default, f.name)]
        return "Plan(" + ", ".join(changed) + ")"
