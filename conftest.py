# Lets tests import their shared helpers (tests/harness.py) by name.
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))
