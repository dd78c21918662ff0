"""The registry of external names (glm_infra/spec/packages.py): NVIDIA's per-branch naming rule, a source for
every name, and the rendered host steps of every committed stack naming only what the registry lists."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, STACKS, stack_file

from glm_infra import hostplan
from glm_infra.plan.topology import plan
from glm_infra.spec import install_rules, packages
from glm_infra.spec.config import DriversConfig
from glm_infra.stack import StackError, load_file
from glm_infra.tools import packages_doc

# --- the naming rule per branch ------------------------------------------------------------------

# Expected names written out, from the driver installation guide's 590 rename table and NVIDIA's driver
# container (580: gpu-driver-container 78fa4ac; 595: ubuntu26.04/install.sh; 610: NemoClaw's pins).
BRANCHES = [
    ("580.159.04", "nvidia-driver-580-open", "580.159.04-1ubuntu1", "580.159.04-1",
     ["nvidia-utils-580", "nvidia-compute-utils-580", "nvidia-dkms-580-open", "nvidia-kernel-common-580",
      "libnvidia-compute-580"]),
    ("590.48.01", "nvidia-driver-open", "590.48.01-1ubuntu1", "590.48.01-1ubuntu1", None),
    ("595.71.05", "nvidia-driver-open", "595.71.05-1ubuntu1", "595.71.05-1ubuntu1", None),
    ("610.43.02", "nvidia-driver-open", "610.43.02-1ubuntu1", "610.43.02-1ubuntu1", None),
]
UNSUFFIXED = ["nvidia-utils", "nvidia-compute-utils", "nvidia-dkms-open", "nvidia-kernel-common", "libnvidia-compute"]


@pytest.mark.parametrize("version, driver, driver_version, versioned, family", BRANCHES)
def test_package_names_and_versions_follow_the_branchs_rule(version, driver, driver_version, versioned, family):
    d = DriversConfig(version=version)
    # One pinning package, of the exact version: NVIDIA's pinning packages conflict.
    assert d.pin_package == f"nvidia-driver-pinning-{version}"
    assert d.locked_packages == [driver, "libnvidia-nscq", "nvidia-fabricmanager", "libnvsdm"]
    assert d.family_packages == (family or UNSUFFIXED)
    assert d.tool_packages == ["datacenter-gpu-manager-4-cuda13", "nvlsm", "infiniband-diags"]
    assert d.package_set().units == ("nvidia-persistenced", "nvidia-fabricmanager")
    assert d.package_set(dcgm_exporter=True).units == ("nvidia-persistenced", "nvidia-fabricmanager", "nvidia-dcgm")
    s = d.package_set()
    assert {p.name: p.version_for(version) for p in (*s.locked, *s.family, s.pin)} == {
        driver: driver_version, **{f: driver_version for f in family or UNSUFFIXED}, "libnvidia-nscq": versioned,
        "nvidia-fabricmanager": versioned, "libnvsdm": versioned, f"nvidia-driver-pinning-{version}": versioned}


def test_the_driver_depends_on_its_family_at_exactly_its_version():
    for version in ("580.159.04", "595.71.05"):
        s = packages.driver_set(version, True, False)
        assert s.locked[0].exact_depends == tuple(p.name for p in s.family)


def test_only_branch_580s_fabric_packages_provide_the_suffixed_names():
    provides = {p.name: p.provides for p in packages.driver_set("580.159.04", True, False).locked if p.provides}
    assert provides == {"nvidia-fabricmanager": ("nvidia-fabricmanager-580",), "libnvsdm": ("libnvsdm-580",)}
    assert not any(p.provides for p in packages.driver_set("610.43.02", True, False).locked)
    for version in ("580.159.04", "610.43.02"):  # every pinning package, of every branch
        pin = packages.driver_set(version, True, False).pin
        assert pin.provides == pin.conflicts == pin.replaces == ("nvidia-driver-pinning",)


def test_without_fabric_manager_neither_its_packages_nor_its_unit():
    d = DriversConfig(fabric_manager=False)
    assert d.locked_packages == ["nvidia-driver-580-open", "libnvidia-nscq"]
    assert d.tool_packages == ["datacenter-gpu-manager-4-cuda13"]
    assert d.package_set().units == ("nvidia-persistenced",)
    assert DriversConfig(fabric_manager=False, dcgm_diag_level=1).package_set().units == ("nvidia-persistenced", "nvidia-dcgm")


@pytest.mark.parametrize("version", ["575.64.05", "620.12.01", "600.20.01"])
def test_a_branch_without_a_naming_rule_is_refused(version, tmp_path):
    path = tmp_path / "Pulumi.bad.yaml"
    path.write_text(stack_file("prod-b300").read_text().replace("version: 580.159.04", f"version: {version}"))
    with pytest.raises(StackError) as e:
        load_file(path)
    message = str(e.value)
    assert f"glm-infra:drivers.version: no package naming rule for driver branch {version.split('.')[0]}" in message
    assert "known: 580, 590, 595, 610" in message


# --- every name has a source ---------------------------------------------------------------------

SOURCE = re.compile(r"^(https?://\S+|[\w.-]+/[\w.-]+@[0-9a-f]{40}:\S+|glm-infra issue \d+ \(.+\))$")


def cited(sources) -> bool:
    return bool(sources) and all(SOURCE.match(s.ref) and s.shows for s in sources)


def test_every_package_repository_unit_module_and_rule_cites_a_source():
    for p in packages.PACKAGES:
        assert cited(p.sources), p.name
        assert p.repository in packages.REPOSITORIES, p.name
        assert set(p.units) <= set(packages.UNITS), p.name
    for r in packages.RULES:
        assert cited(r.sources), r.branches
    for rule in install_rules.INSTALL_RULES:
        assert cited(rule.sources) and rule.action and rule.standin, rule.rule
    for repo in packages.REPOSITORIES.values():
        assert cited(repo.sources), repo.key
    for u in packages.UNITS.values():
        assert cited(u.sources), u.name
    for m, sources in packages.KERNEL_MODULES.items():
        assert cited(sources), m


def test_the_docs_page_is_the_registry():
    """docs/PACKAGES.md (regenerate: venv/bin/python -m glm_infra.tools.packages_doc > docs/PACKAGES.md)."""
    assert (ROOT / "docs" / "PACKAGES.md").read_text() == packages_doc.markdown()


# --- the rendered steps name only what the registry lists -----------------------------------------

# A vendor's package, unit, binary or module name as it stands in a script (not a variable like
# dcgm_level, not part of a path or of glm-infra's own file names).
NAME = re.compile(r"(?<![\w./-])((?:lib)?nv(?:idia|sdm|lsm)[a-z0-9.+-]*|nv-[a-z0-9.+-]+|datacenter-gpu-manager[a-z0-9.+-]*"
                  r"|dcgm[a-z0-9.+-]*|doca[a-z0-9.+-]*|(?:infiniband|rdma|ibverbs)-[a-z0-9.+-]+)(?![\w/])")
VENDOR_WORDS = {"nvidia", "dcgm", "doca"}  # the vendor or product, not a name (a Prometheus job is called dcgm)
UNIT = re.compile(r"(?<![\w.-])((?:nvidia|nvlsm|dcgm|nv-)[\w.@-]*\.service)\b")
URL = re.compile(r"https?://[^\s\"']+")


def rendered(stack: str) -> dict[str, str]:
    """Every file and step script of every host of the stack, by host:path."""
    cfg = load_file(stack_file(stack)).config
    out = {}
    for host, hs in hostplan.plan_all(cfg, plan(cfg), stack_name=stack).items():
        out.update({f"{host}:{path}": f.content for path, f in hs.files().items()})
        out.update({f"{host}:step {key}": f"{st.create}\n{st.stdin or ''}" for key, st in hs.steps.items()})
    return out


@pytest.mark.parametrize("stack", STACKS)
def test_rendered_steps_name_only_cited_packages_and_units(stack):
    cfg = load_file(stack_file(stack)).config
    allowed = packages.cited_names((cfg.drivers.version,))
    virtual = packages.virtual_names((cfg.drivers.version,))
    for where, text in rendered(stack).items():
        names = {m.rstrip(".") for m in NAME.findall(text) if not m.endswith("-")} - VENDOR_WORDS  # not a prefix in a pattern
        assert not names & virtual, f"{where} installs a virtual package: {sorted(names & virtual)}"
        assert names <= allowed, f"{where} names what glm_infra/spec/packages.py does not list: {sorted(names - allowed)}"
        units = set(UNIT.findall(text))
        assert units <= set(packages.UNITS), f"{where} names units no package ships: {sorted(units - set(packages.UNITS))}"


@pytest.mark.parametrize("stack", STACKS)
def test_driver_and_rdma_steps_enable_only_shipped_units_from_cited_repositories(stack):
    cfg = load_file(stack_file(stack)).config
    configured = {cfg.drivers.apt_repository, cfg.drivers.apt_keyring_url, cfg.rdma.doca_repository_url,
                  cfg.rdma.doca_keyring_url}  # the stack's own choice (the simulated cluster's repository)
    for where, text in rendered(stack).items():
        if where.endswith(("/drivers.sh", "/rdma.sh")):
            urls = set(URL.findall(text))
            assert urls <= packages.cited_urls() | configured, f"{where}: {sorted(urls - packages.cited_urls())}"
        if where.endswith("/drivers.sh"):
            services = re.search(r"^services=\((.*)\)$", text, re.M)
            assert services, where
            assert {f"{s}.service" for s in services.group(1).split()} <= set(packages.UNITS), services.group(0)
            assert "nvlsm" not in services.group(1).split()  # it has no unit: the fabric manager's starts it
