"""`python -m treadle.cli ...`: the `treadle` command."""

import sys

from . import main

sys.exit(main())
