"""``python -m treadle.run``: the training entry point torchrun launches on every rank."""

import sys

from .loop import main

sys.exit(main())
