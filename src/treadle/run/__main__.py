"""``python -m treadle.run``: the training entry point torchrun launches on every rank."""

import gc
import os
import sys

from .failure import EXIT_FAULT
from .loop import main

status = main()
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
