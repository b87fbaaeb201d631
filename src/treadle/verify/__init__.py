"""Numerical verification of a schedule against the original model (forward, backward, optimizer step)."""

from .compare import Tolerance, tolerance
from .shrink import CarriedSchedule, carry_schedule
from .verify import Check, VerifyReport, verify

__all__ = ["verify", "VerifyReport", "Check", "Tolerance", "tolerance", "carry_schedule", "CarriedSchedule"]
