"""Speculative decoding with a draft model; `fake_runner` lives one directory up."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
