"""scripts/pr-review runs this (python -m glm_infra.tools.review)."""

import sys

from .cli import pr_main

sys.exit(pr_main())
