"""NOTE [torchao's import noise]: transformers imports torchao wherever it is installed (treadle's float8 needs it),
and on a host without CUDA that import logs a warning per CUDA-only kernel library it cannot load ("Failed to
load .../_C_mxfp8...so") and, through torch's pytree, a deprecation per enum it registers. Neither says anything
about the user's job, and the command line promises a clean stderr; `install` adds a filter to exactly those two
loggers that drops exactly those records (a CUDA host still hears of a library that fails to load)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


def _noise(record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    if record.name == "torchao" and msg.startswith("Failed to load") and ".so" in msg:
        torch = sys.modules.get("torch")
        return torch is not None and not torch.cuda.is_available()
    if record.name == "torch.utils._pytree" and "is an Enum subclass" in msg:
        return any(getattr(a, "__module__", "").startswith("torchao") for a in (record.args or ()))
    return False


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _noise(record)


_FILTER = _Quiet()


def install() -> None:
    """Add the filter of NOTE [torchao's import noise] to its two loggers (once)."""
    for name in ("torchao", "torch.utils._pytree"):
        log = logging.getLogger(name)
        if _FILTER not in log.filters:
            log.addFilter(_FILTER)


# NOTE [a native solver's stdout]: HiGHS (through scipy's `milp`) may print from C to the process's stdout whatever
# its options say (a line such as "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" when it
# repairs a presolved solution). `treadle plan --json` prints the plan on stdout, so such a line would corrupt it.
# While a solve runs, file descriptor 1 points at stderr; C's buffers are flushed before it is restored, so nothing
# the solver wrote reaches stdout later. Python's own `sys.stdout` is flushed first and is untouched otherwise.
@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Send what native code writes to file descriptor 1 to stderr while the block runs (NOTE [a native solver's
    stdout]). Does nothing where descriptors 1 or 2 cannot be duplicated."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
