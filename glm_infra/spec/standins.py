"""The stand-in packages of the simulated cluster, built from the registry (``packages.py``) with the real
names, versions and relations: ``python3 glm_infra/spec/standins.py standins [--kernel RELEASE]`` prints
what testbed/standins/build-apt-repo builds. Standard library only: it runs as a file, with a plain python3."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

if __package__:
    from . import packages as registry
    from .package_model import DocaRelease, Package
else:  # run as a file by testbed/standins/build-apt-repo (a plain python3): this folder is on sys.path
    import packages as registry  # type: ignore[no-redef]
    from package_model import DocaRelease, Package  # type: ignore[no-redef]

# The driver versions the stand-in repository carries: the stacks' default, a second 580 (the simulated
# cluster moves the driver: upgrade, reboot, downgrade), branch 595 (the move across the 590 rename), and
# of each branch a newer release than any stack pins, as NVIDIA's repository always has one (so a pin that
# is missing or comes too late bites). The ".999." releases are the stand-ins' own (no real release has them).
SIM_DRIVERS = ("580.159.04", "580.172.08", "580.999.01", "595.71.05", "595.999.01")
# The releases the stand-in DOCA repository serves: the stacks' default and a newer one, in one folder
# (as on a host with a second DOCA source), so an RDMA step that does not pin DOCA's own packages meets
# the newer ones. The newer release's numbers are the stand-ins' own (no real release has them).
SIM_DOCAS = (DocaRelease(registry.cite.DOCA_VERSION, "3.1.0-091000", "2507mlnx56-1"),
             DocaRelease("3.99.0", "3.99.0-999000", "2599mlnx99-1"))
# Which stand-in repository serves a package: the main one stands in for NVIDIA's CUDA repository
# and the distribution's mirror, doca/ for NVIDIA's DOCA repository.
STANDIN_REPOSITORY = {"cuda": ".", "ubuntu": ".", "doca": "doca"}


@dataclass(frozen=True)
class StandinBuild:
    """One stand-in .deb: its debs/<dir>, control fields from the registry, and the repository folder."""

    dir: str
    package: str
    version: str
    provides: str
    depends: str
    conflicts: str
    replaces: str
    repository: str

    def row(self) -> str:
        return "\t".join(x or "-" for x in (self.dir, self.package, self.version, self.provides, self.depends,
                                             self.conflicts, self.replaces, self.repository))


def _build(q: Package, version: str, depends_on: dict[str, str]) -> StandinBuild:
    depends = [f"{d} (= {depends_on.get(d, version)})" for d in q.exact_depends] + list(q.depends)
    return StandinBuild(q.standin, q.name, version, ", ".join(q.provides), ", ".join(depends),
                        ", ".join(q.conflicts), ", ".join(q.replaces), STANDIN_REPOSITORY[q.repository])


def standin_builds(drivers: tuple[str, ...] = SIM_DRIVERS, kernel: str = "") -> list[StandinBuild]:
    """Every stand-in build: the driver-versioned packages once per driver version, DOCA's once per DOCA
    release, the running kernel's for ``kernel`` (none without one), the others once."""
    rows: dict[tuple[str, str, str], StandinBuild] = {}

    def add(b: StandinBuild) -> None:
        rows.setdefault((b.package, b.version, b.repository), b)

    r = registry
    for v in drivers:
        for p in r.PACKAGES:
            if not p.standin or p.repository == "doca" or "{kernel}" in p.name:
                continue
            q = r.resolve(p, v)
            add(_build(q, q.version_for(v), {r.LIBIBNETDISC.name: r.LIBIBNETDISC.standin_version}))
    for d in SIM_DOCAS:
        comps = {c.name: d.components for c in r.DOCA_COMPONENTS}
        ofed = replace(r.DOCA_OFED, exact_depends=tuple(comps))
        add(_build(ofed, d.build, comps))
        for c in r.DOCA_COMPONENTS:
            add(_build(c, d.components, {}))
    if kernel:
        for p in (r.LINUX_HEADERS, r.LINUX_MODULES_EXTRA):
            add(_build(replace(p, name=p.name.format(kernel=kernel)), "1.0-1", {}))
    return list(rows.values())


def _main(argv: list[str]) -> int:
    if argv[:1] != ["standins"]:
        print("usage: standins.py standins [--kernel RELEASE] [DRIVER_VERSION...]", file=sys.stderr)
        return 2
    args, kernel = argv[1:], ""
    if args[:1] == ["--kernel"]:
        if len(args) < 2:
            print("standins.py standins: --kernel needs a release (uname -r)", file=sys.stderr)
            return 2
        kernel, args = args[1], args[2:]
    for b in standin_builds(tuple(args) or SIM_DRIVERS, kernel):
        print(b.row())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
