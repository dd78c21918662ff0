"""The repository on sys.path for a benchmark run as ``venv/bin/python scripts/bench/<name>.py``: the
benchmarks import the test bed (testbed.bench, testbed.cluster) and glm_infra from the checkout."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
