"""docs/PACKAGES.md: the registry of external names (``glm_infra/spec/packages.py``) as a page; a test
keeps the two equal. ``venv/bin/python -m glm_infra.tools.packages_doc > docs/PACKAGES.md`` writes it."""

from __future__ import annotations

from glm_infra.spec import install_rules, packages, standins


def _cite(sources: tuple[packages.Source, ...]) -> str:
    return "<br>".join(f"`{s.ref}`: {s.shows}" for s in sources)


def _names(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) or "—"


def _relations(p: packages.Package) -> str:
    parts = []
    if p.exact_depends:
        parts.append("Depends (= its version): " + _names(p.exact_depends))
    if p.conflicts:
        parts.append("Conflicts: " + _names(p.conflicts))
    if p.replaces:
        parts.append("Replaces: " + _names(p.replaces))
    return "<br>".join(parts) or "—"


def markdown() -> str:
    """docs/PACKAGES.md, from the registry."""
    lines = [
        "# External names: packages, repositories, units, install rules",
        "",
        "Generated from `glm_infra/spec/packages.py` and the modules beside it (`units.py`, `host_packages.py`,",
        "`install_rules.py`, `standins.py`, `repositories.py`)",
        "(`venv/bin/python -m glm_infra.tools.packages_doc > docs/PACKAGES.md`); edit those, not this page.",
        "Every name a host script relies on is listed there once, with where NVIDIA (or Ubuntu) documents",
        "it, and so are the relations apt resolves the packages by and the install rules they impose; the",
        "driver, RDMA, health-gate and monitoring steps take their names from it, the simulated cluster's",
        "stand-in packages are built from it with the same relations, and a test fails when a rendered",
        "script names a package, unit or repository it does not list. A source is a URL or",
        "`owner/repo@commit:path#lines` on GitHub; `glm-infra issue N (…)` names a capture an issue brought.",
        "",
        "## Install rules",
        "",
        "What the real packages (or apt) do that decides how they must be installed, and what glm-infra does",
        "about it. \"Settled\": a source shows the behaviour; otherwise no source here settles it and",
        "glm-infra guards against it with a check that stops naming the cause.",
        "",
        "| the packages | glm-infra | settled | the stand-ins | sources |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in install_rules.INSTALL_RULES:
        lines.append(f"| {r.rule} | {r.action} | {'yes' if r.settled else 'no'} | {r.standin} | {_cite(r.sources)} |")
    lines += [
        "",
        "## Driver branches",
        "",
        "A driver version whose branch has no rule here is refused (`drivers.version`): NVIDIA renamed most",
        "packages at branch 590. The driver depends on its family at exactly its own version.",
        "",
        "| branches | driver package | its version (and its family's) | fabric manager, NSCQ, NVSDM, version pin | "
        "family | fabric manager / NVSDM also provide | sources |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in packages.RULES:
        virt = "`nvidia-fabricmanager-<branch>`, `libnvsdm-<branch>`" if r.suffixed_virtuals else "—"
        lines.append(f"| {', '.join(r.branches)} | `{r.driver}` | `{r.driver_scheme}` | `{r.versioned_scheme}` | "
                     f"{_names(list(r.family.values()))} | {virt} | {_cite(r.sources)} |")
    lines += ["", "The names of the driver tree, of any branch: " + _names(packages.DRIVER_TREE_NAMES)
              + " (with `-<branch>`, `-server`, `-open`). A driver change across branches removes the installed "
              "ones of the other naming.",
              "", "## Packages", "",
              "| package | role | repository | version | provides | relations | units | binaries, paths | "
              "what glm-infra does | sources |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in packages.PACKAGES:
        scheme = "any (held)" if p.scheme == "any" else f"`{p.scheme}`"
        if p.scheme in ("{driver_scheme}", "{versioned}"):
            scheme = "per branch (above)"
        provides = _names(p.provides + tuple(f"{v} (580)" for v in p.branch_virtuals))
        cells = [f"`{p.name}`", p.role, p.repository, scheme, provides, _relations(p), _names(p.units),
                 _names(p.binaries + p.paths), p.note or "—", _cite(p.sources)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "DOCA replaces these packages of Ubuntu's with its own builds; the RDMA step lets exactly these "
              "change where they are held: " + _names(packages.DOCA_REPLACES) + ".",
              "", "## Repositories", "", "| key | deb line URL | signing key | sources |", "| --- | --- | --- | --- |"]
    for r in packages.REPOSITORIES.values():
        lines.append(f"| {r.key} | `{r.url}` | {f'`{r.keyring_url}`' if r.keyring_url else '—'} | {_cite(r.sources)} |")
    lines += ["", "## Systemd units", "", "| unit | shipped by | enabled | sources |", "| --- | --- | --- | --- |"]
    for u in packages.UNITS.values():
        lines.append(f"| `{u.name}` | {u.package} | {u.enable} | {_cite(u.sources)} |")
    lines += ["", "## Kernel modules", "",
              "Loaded and persisted (`/etc/modules-load.d`) by the driver step before the fabric manager starts: "
              + _names(packages.FABRIC_MODULES) + ".", "", "| module | sources |", "| --- | --- |"]
    for m, src in packages.KERNEL_MODULES.items():
        lines.append(f"| `{m}` | {_cite(src)} |")
    lines += ["", "## Stand-ins", "",
              "`testbed/standins/build-apt-repo` builds every package above that has a stand-in (`debs/<dir>`) with",
              "the registry's name, version and relations (`Provides:`, `Depends:` at exact versions, `Conflicts:`,",
              "`Replaces:`) and repository: the driver-versioned ones for each of "
              + _names(standins.SIM_DRIVERS) + " (of each branch a release newer than any stack pins, so a pin",
              "that is missing or late bites), DOCA's for each of "
              + _names([d.version for d in standins.SIM_DOCAS]) + ", in one folder, and the running kernel's",
              "(`linux-headers-<kernel>`, `linux-modules-extra-<kernel>`) for the machine's kernel, which the",
              "simulated hosts share. Its `apt/` folder stands in for the CUDA repository and the distribution's",
              "mirror, `apt/doca/` for the DOCA repository. The stand-ins ship only the units listed here, plus",
              "`nvidia-sim-module.service`, which loads the simulated kernel module at boot, and",
              "`simulated-modules-load.service`, which loads the simulated kernel's modules of `modules-load.d` at boot",
              "(systemd-modules-load skips containers); no host script names either.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
