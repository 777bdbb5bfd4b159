"""``python -m gockpt.cli``: the ``gockpt`` console tool."""

import sys

from . import main

sys.exit(main())
