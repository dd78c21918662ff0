"""docs/PACKAGES.md: the registry of external names (``glm_infra/spec/packages.py``) as a page; a test
keeps the two equal. ``venv/bin/python -m glm_infra.tools.packages_doc > docs/PACKAGES.md`` writes it."""

from __future__ import annotations

from glm_infra.spec import packages


def _cite(sources: tuple[packages.Source, ...]) -> str:
    return "<br>".join(f"`{s.ref}`: {s.shows}" for s in sources)


def markdown() -> str:
    """docs/PACKAGES.md, from the registry."""
    lines = [
        "# External names: packages, repositories, units",
        "",
        "Generated from `glm_infra/spec/packages.py` and `repositories.py` beside it",
        "(`venv/bin/python -m glm_infra.tools.packages_doc > docs/PACKAGES.md`); edit those, not this page.",
        "Every name a host script relies on is listed there once, with where NVIDIA (or Ubuntu) documents",
        "it; the driver, RDMA, health-gate and monitoring steps take their names",
        "from it, the simulated cluster's stand-in packages are built from it, and a test fails when a rendered",
        "script names a package, unit or repository it does not list. A source is a URL or",
        "`owner/repo@commit:path#lines` on GitHub.",
        "",
        "## Driver branches",
        "",
        "A driver version whose branch has no rule here is refused (`drivers.version`): NVIDIA renamed most",
        "packages at branch 590.",
        "",
        "| branches | driver package | its version | fabric manager / NVSDM also provide | sources |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in packages.RULES:
        virt = "`nvidia-fabricmanager-<branch>`, `libnvsdm-<branch>`" if r.suffixed_virtuals else "—"
        lines.append(f"| {', '.join(r.branches)} | `{r.driver}` | `{r.driver_scheme}` | {virt} | {_cite(r.sources)} |")
    lines += ["", "## Packages", "",
              "| package | role | repository | version | provides | units | binaries, paths | sources |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in packages.PACKAGES:
        scheme = "any (held)" if p.scheme == "any" else f"`{p.scheme}`"
        if p is packages.DRIVER:
            scheme = "per branch (above)"
        cells = [f"`{p.name}`", p.role, p.repository, scheme, ", ".join(f"`{v}`" for v in p.provides) or "—",
                 ", ".join(f"`{u}`" for u in p.units) or "—",
                 ", ".join(f"`{b}`" for b in p.binaries + p.paths) or "—", _cite(p.sources)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Repositories", "", "| key | deb line URL | signing key | sources |", "| --- | --- | --- | --- |"]
    for r in packages.REPOSITORIES.values():
        lines.append(f"| {r.key} | `{r.url}` | {f'`{r.keyring_url}`' if r.keyring_url else '—'} | {_cite(r.sources)} |")
    lines += ["", "## Systemd units", "", "| unit | shipped by | enabled | sources |", "| --- | --- | --- | --- |"]
    for u in packages.UNITS.values():
        lines.append(f"| `{u.name}` | {u.package} | {u.enable} | {_cite(u.sources)} |")
    lines += ["", "## Kernel modules", "", "| module | sources |", "| --- | --- |"]
    for m, src in packages.KERNEL_MODULES.items():
        lines.append(f"| `{m}` | {_cite(src)} |")
    lines += ["", "## Stand-ins", "",
              "`testbed/standins/build-apt-repo` builds every package above that has a stand-in (`debs/<dir>`) with",
              "the registry's name, version, `Provides:` and repository: the driver-versioned ones for each of "
              + ", ".join(f"`{v}`" for v in packages.SIM_DRIVERS) + ". Its `apt/` folder stands in for",
              "the CUDA repository and the distribution's mirror, `apt/doca/` for the DOCA repository. The",
              "stand-ins ship only the units listed here, plus `nvidia-sim-module.service`, which loads the",
              "simulated kernel module at boot and which no host script names.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
