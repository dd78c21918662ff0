"""What the Pulumi engine running the program must allow, checked before any resource: an `up` whose
--parallel is below ``topology.parallel_needed`` is refused (a preview warns), naming the value to pass."""

from __future__ import annotations

import pulumi
from pulumi.runtime import settings

from ..plan import topology
from ..spec.config import StackConfig


def check_parallel(stack: StackConfig, plan: topology.Plan, resource: pulumi.Resource) -> None:
    """Refuse an `up` the engine could deadlock in; None (mocks, or an engine that does not say) is not judged."""
    parallel, need = getattr(settings.SETTINGS, "parallel", None), topology.parallel_needed(stack, plan)
    if not parallel or parallel >= need:
        return
    why = (f"pulumi runs {parallel} resource operations at once (--parallel), fewer than the {need} this stack "
           "needs (every host that stages the weights, one per pool, one to spare): a relay peer's step that starts "
           "before its parent's waits for it holding one of them, forever once they are all taken. "
           f"Run `pulumi up --parallel {need}` or more")
    if pulumi.runtime.is_dry_run():
        pulumi.log.warn(f"{why}; `pulumi up` at this --parallel is refused", resource)
        return
    raise pulumi.RunError(f"{why}. Refused before any resource.")
