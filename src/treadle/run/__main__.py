"""``python -m treadle.run``: the training entry point torchrun launches on every rank."""

import gc
import sys

from .loop import main

status = main()
# the interpreter's final collection would walk every object torch, transformers and the run made (seconds
# per rank, and torchrun waits for the slowest); they are freed with the process instead
gc.freeze()
sys.exit(status)
