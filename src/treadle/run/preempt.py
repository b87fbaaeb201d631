"""Preemption: SIGTERM (what a cluster scheduler sends before it kills a job) or SIGUSR1 (Slurm's
``--signal``) asks the run to save a checkpoint at the next step boundary and exit cleanly. The handler only
notes the signal; the step's all-reduce (`step.run_step`) tells every rank, so the ranks agree even when the
signal reached only some of them. A second signal is noted again and changes nothing: the save is under way.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Within ``with StopSignals() as s:``, SIGTERM and SIGUSR1 set `s.received` (the first signal's name) and
    `s.signum` (its number) instead of ending the process; the previous handlers come back on exit. Outside the
    main thread it does nothing (Python delivers signals to the main thread only)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: str | None = None
        self.signum = 0
        self._old: dict[signal.Signals, object] = {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            logger.warning("%s received: saving a checkpoint at the next step boundary, then exiting", name)
        self.received = self.received or name
        self.signum = self.signum or signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._old[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]  # a handler, SIG_DFL or SIG_IGN
        self._old.clear()
