"""``python -m glm_infra.agent.canary``, and the program glm-infra bundles for the router's host."""

import sys

from .cli import main

sys.exit(main())
