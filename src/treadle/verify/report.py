"""What `verify` reports: one `Check` per comparison, and the `VerifyReport` of a run."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import VerifyError
from .compare import Diff


@dataclass(frozen=True)
class Check:
    """One comparison: `kind` is loss / output / output_grad / input_grad / param_grad / param_step."""

    kind: str
    name: str
    diff: Diff

    def __str__(self) -> str:
        status = "ok " if self.diff.ok else "BAD"
        extra = f" [{self.diff.layout}]" if self.diff.layout else ""
        note = f" ({self.diff.note})" if self.diff.note else ""
        return (f"{status} {self.kind:<12} {self.name:<48} max_abs={self.diff.max_abs:.3e} "
                f"max_rel={self.diff.max_rel:.3e}{extra}{note}")


@dataclass
class VerifyReport:
    """Outcome of `verify`. `ok` is True when every check passed; `first_divergence` names the first
    module whose output (forward order) or gradient (backward order) diverges; `error` holds a build or
    runtime failure on a rank (with the module path where it happened when known); `notes` what else explains a
    failure (a forward that draws random numbers: NOTE [random draws in verify])."""

    checks: list[Check] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    first_divergence: str | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)  # what explains a failure besides the checks (random draws)

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.diff.ok for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.diff.ok]

    def summary(self) -> str:
        if self.error is not None:
            return f"verify FAILED: {self.error}"
        n_bad = len(self.failures())
        head = "verify ok" if self.ok else f"verify FAILED: {n_bad} of {len(self.checks)} checks"
        lines = [f"{head}; losses {['%.6f' % x for x in self.losses]} vs reference "
                 f"{['%.6f' % x for x in self.ref_losses]}"]
        if self.first_divergence:
            lines.append(f"first divergence: {self.first_divergence}")
        lines += [f"note: {n}" for n in self.notes]
        lines += [str(c) for c in self.failures()[:10]]
        return "\n".join(lines)

    def raise_if_failed(self) -> "VerifyReport":
        if not self.ok:
            raise VerifyError(self.summary())
        return self
