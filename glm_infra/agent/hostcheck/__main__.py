"""``python -m glm_infra.agent.hostcheck``, and the program glm-infra bundles for every host."""

import sys

from .cli import main

sys.exit(main())
