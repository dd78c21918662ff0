"""``glm-infra fleet preview`` and ``status`` as text: per stack, what its preview changes and where, which
services restart and how much of each pool that is (the blast radius); and how far a rollout got."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from glm_infra import hostplan
from glm_infra.plan import topology
from glm_infra.stack import load_file

from ..review.preview import OPS, PreviewSummary
from ..review.rendering import Instance, Rendering
from . import progress
from .spec import Fleet


def rendering_now(fleet: Fleet, stack: str) -> Rendering:
    """``stack`` as the project's stack file and this glm_infra render it (what its preview's commands run)."""
    loaded = load_file(fleet.project / "stacks" / f"Pulumi.{stack}.yaml")
    plan = topology.plan(loaded.config)
    steps = hostplan.plan_all(loaded.config, plan, stack_name=stack)
    files = {rel: (f.content, f.mode if f.path else 0o644) for rel, f in hostplan.tree(steps).items()}
    instances = {i.name: Instance(i.name, i.role, i.host, i.unit) for i in plan.instances}
    router = (plan.router.host, plan.router.unit) if plan.router else None
    return Rendering(files, {h.name: h.address for h in plan.hosts}, instances, router)


def _unit(name: str) -> str:
    return name.removesuffix(".service")


@dataclass(frozen=True)
class BlastRadius:
    pools: dict[str, tuple[int, int]]  # pool → (instances restarting, instances)
    router: bool  # the router restarts
    hosts: list[str]  # hosts with a resource created, updated, replaced or deleted

    def text(self) -> str:
        pools = ", ".join(f"{p} {n}/{total}" for p, (n, total) in sorted(self.pools.items()))
        return (f"instances restarting: {pools or 'none'}; router restarts: {'yes' if self.router else 'no'}; "
                f"hosts changed: {', '.join(self.hosts) or 'none'}")


def blast_radius(summary: PreviewSummary, rendering: Rendering) -> BlastRadius:
    restarting = {_unit(r.rsplit(": ", 1)[-1]) for r in summary.restarts}
    pools: dict[str, tuple[int, int]] = {}
    for inst in rendering.instances.values():
        n, total = pools.get(inst.pool, (0, 0))
        pools[inst.pool] = (n + (_unit(inst.unit) in restarting), total + 1)
    router = rendering.router is not None and _unit(rendering.router[1]) in restarting
    changed = [n for op in OPS for n in summary.resources[op]]
    named = {h for n in changed for h in rendering.hosts_named(n)}
    hosts = [h for h in rendering.hosts if h in named]
    return BlastRadius(pools, router, hosts)


def preview_text(fleet: Fleet, previews: Mapping[str, PreviewSummary | str],
                 radii: Mapping[str, BlastRadius]) -> str:
    out = [f"glm-infra fleet preview {fleet.name} ({fleet.source}): {len(fleet.stacks)} stacks in "
           f"{len(fleet.waves)} waves"]
    for i, wave in enumerate(fleet.waves, 1):
        out.append(f"\nwave {i} {wave.name} (at most {wave.parallel} at once)")
        for s in wave.stacks:
            p = previews[s]
            if isinstance(p, str):
                out.append(f"  {s}: preview {p}")
                continue
            counts = ", ".join(f"{p.counts[k]} to {k}" for k in OPS if p.counts[k])
            out.append(f"  {s}: {counts or 'no change'}")
            out += [f"    error: {e}" for e in p.errors]
            if s in radii:
                out.append(f"    blast radius: {radii[s].text()}")
            out += [f"    restarts {r}" for r in p.restarts]
            for op in OPS:
                if p.resources[op]:
                    out.append(f"    {op}: {', '.join(p.resources[op])}")
    return "\n".join(out) + "\n"


def _ago(at: float) -> str:
    s = max(0, time.time() - at)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def status_text(fleet: Fleet, records: Mapping[str, progress.StackRecord], targets: Mapping[str, str],
                latest: Mapping[str, tuple[str, str] | None | str]) -> str:
    """Per stack: its record (phase, why, when), whether that is today's target, and whether the stack's
    backend still has the recorded update as its latest (``latest``: (update_id, result), None, or an error)."""
    out = [f"glm-infra fleet status {fleet.name} ({fleet.source})"]
    for i, wave in enumerate(fleet.waves, 1):
        out.append(f"\nwave {i} {wave.name}")
        for s in wave.stacks:
            rec, now = records.get(s), latest.get(s)
            backend = (f"latest {now[0]} {now[1]}" if isinstance(now, tuple)
                       else "no update yet" if now is None else f"backend: {now}")
            if rec is None:
                out.append(f"  {s}: not rolled by this fleet; {backend}")
                continue
            target = "the current target" if rec.target == targets.get(s) else "an older target"
            line = f"  {s}: {rec.phase} {_ago(rec.at)}, {target}"
            if rec.update is not None:
                line += f", by {rec.update}"
                if isinstance(now, tuple) and now[0] != rec.update:
                    line += f" (the stack has had {now[0]} since: it rolls again)"
            out.append(f"{line}; {backend}")
            if rec.reason:
                out += [f"    {ln}" for ln in rec.reason.splitlines()]
    return "\n".join(out) + "\n"
