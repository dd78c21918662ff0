"""``glm-infra fleet``: the stacks of one project rolled as SREs roll anything, a canary stack first, then
waves, each stack's doctor and SLA gate as the judge between waves, stopping at the first failure and
resumable after it (``spec``: the fleet file; ``rollout``: the waves; ``progress``: what a resume trusts)."""
