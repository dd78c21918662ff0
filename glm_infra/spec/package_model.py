"""The types of the registry of external names (``packages.py`` beside it): a systemd unit, a package with
its version scheme and relations, a driver branch's naming rule, an install rule, a DOCA release of the
stand-ins. Standard library only, as the registry is."""

from __future__ import annotations

from dataclasses import dataclass

if __package__:
    from .repositories import Source
else:  # run as a file by testbed/standins/build-apt-repo (a plain python3): this folder is on sys.path
    from repositories import Source  # type: ignore[no-redef]


@dataclass(frozen=True)
class Unit:
    name: str  # with its suffix
    package: str  # the package that ships the file (may be a dependency of the one installed)
    enable: str  # who enables it, and when glm-infra does
    sources: tuple[Source, ...]


# Version schemes: {version} is the driver's (580.159.04), {branch} its branch (580), {dcgm} and {doca}
# the other release trains, N a packaging revision, {driver_scheme} and {versioned} the branch rule's.
# The scripts match the part before the revision: "<version>-" for the driver-versioned packages,
# "<doca>-" for DOCA.


@dataclass(frozen=True)
class Package:
    name: str  # for a per-branch name the rule fills in {branch} / {version} / the family's roles
    role: str  # drivers | fabric | dcgm | rdma | monitoring | kernel
    repository: str  # key of REPOSITORIES
    scheme: str  # version scheme (see above); "any" for packages held at whatever version the repo has
    sources: tuple[Source, ...]
    provides: tuple[str, ...] = ()  # virtual packages it provides on every branch (so installing these fails)
    branch_virtuals: tuple[str, ...] = ()  # virtual packages it provides where the branch rule says so
    conflicts: tuple[str, ...] = ()  # apt removes these (or refuses) when installing it
    replaces: tuple[str, ...] = ()
    exact_depends: tuple[str, ...] = ()  # packages it depends on at exactly its own version
    depends: tuple[str, ...] = ()  # other dependencies the stand-in mirrors (unversioned)
    units: tuple[str, ...] = ()  # units it ships
    binaries: tuple[str, ...] = ()  # programs glm-infra or the units run
    paths: tuple[str, ...] = ()  # configuration and data paths that matter
    standin: str = ""  # testbed/standins/debs/<standin>
    standin_version: str = ""  # the version the stand-in carries when it does not follow the driver
    note: str = ""  # what glm-infra does with it, where that is not plain install-and-hold

    def version_for(self, driver: str) -> str:
        """The stand-in's version for driver version ``driver``."""
        if self.standin_version:
            return self.standin_version
        return self.scheme.format(version=driver, branch=driver.split(".")[0])



@dataclass(frozen=True)
class BranchRule:
    """How NVIDIA names and versions the driver packages of some branches in its Ubuntu repository."""

    branches: tuple[str, ...]
    driver: str  # the open-kernel-module driver metapackage
    driver_scheme: str  # its version, and its family's
    versioned_scheme: str  # fabric manager, NSCQ, NVSDM and the exact-version pinning package
    suffixed_virtuals: bool  # fabric manager and NVSDM provide their old "-<branch>" names
    family: dict[str, str]  # FAMILY_ROLES -> package name ({branch} filled in)
    tree_branch: bool  # the tree's names carry the branch ("nvidia-utils-580"), or not ("nvidia-utils")
    sources: tuple[Source, ...]


class UnknownBranch(ValueError):
    pass


@dataclass(frozen=True)
class InstallRule:
    """A behaviour of the real packages that decides how they must be installed."""

    rule: str  # what the real packages (or apt) do
    action: str  # what glm-infra does about it: the order, the pin, or the check that stops with a message
    settled: bool  # a source shows it (else: no source here settles it, and glm-infra guards against it)
    standin: str  # how the simulated cluster's stand-ins reproduce it
    sources: tuple[Source, ...]



@dataclass(frozen=True)
class DocaRelease:
    """A DOCA release as the stand-in DOCA repository carries it: doca-ofed's version and the version of the
    packages it ships under Ubuntu's rdma-core names."""

    version: str  # 3.1.0
    build: str  # doca-ofed's version
    components: str  # rdma-core, ibverbs-utils, infiniband-diags of this release (DOCA's scheme)

