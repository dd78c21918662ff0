"""``python -m glm_infra.agent.weights``, and the program glm-infra bundles for every host (weights.py)."""

import sys

from .cli import main

sys.exit(main())
