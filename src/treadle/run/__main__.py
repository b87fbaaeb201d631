"""``python -m treadle.run``: the training entry point torchrun launches on every rank. Its settings are read
and checked (`start`) before the job's modules load."""

import gc
import os
import sys

from .start import settings

cfg = settings()
if isinstance(cfg, int):  # a settings error, said
    sys.exit(cfg)

from .failure import EXIT_FAULT  # noqa: E402
from .loop import run_rank  # noqa: E402

status = run_rank(cfg)
if status == EXIT_FAULT:
    # a peer died or hung and this rank has said so: nothing is left to save, and torchrun's agent waits for
    # every rank to end before it reports, so this one ends now (the interpreter's teardown takes ~1 s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
# the interpreter's final collection would walk every object torch, transformers and the run made (seconds
# per rank, and torchrun waits for the slowest); they are freed with the process instead
gc.freeze()
sys.exit(status)
