"""Stand-in hardware packages (testbed/standins): the signed flat apt repository they build into,
and their tools' output checked against the real formats.

nvidia-smi is compared with real captures from 2x H200 on driver 580.159.04
(shared/fixtures/nvidia-smi/h200x2): same lines, columns, sections and field order, B300 values.
The RDMA and DCGM tools are checked against the layouts their real sources print
(rdma-core devinfo.c and ibstat.c, the MLNX show_gids and ibdev2netdev scripts, perftest's
RESULT_FMT/REPORT_FMT, DCGM 4 dcgmi/Diag.cpp). The tools run straight from the source tree
against a GLM_SIM_ROOT temp dir.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from glm_infra.agent import hostcheck
from testbed import STANDINS
from testbed.hardware import DEBS, DRIVER, HW_LIB, TOOLS, Sim

ROOT = Path(__file__).resolve().parents[2]
B300_TOPO = ROOT / "tests/fixtures/nvidia-smi-topo/sglang-issue-26039-b300-8gpu-9nic-bond-tabs-ansi-remnants.txt"
FIXTURES = ROOT / "tests" / "fixtures" / "h200x2-nvidia-smi"  # copied from shared/fixtures/nvidia-smi/h200x2
SHELLCHECK = ROOT / "venv" / "bin" / "shellcheck"

KERNEL = os.uname().release  # the machine's kernel, which the simulated hosts share
FAMILY = ("nvidia-utils-580", "nvidia-compute-utils-580", "nvidia-dkms-580-open", "nvidia-kernel-common-580",
          "libnvidia-compute-580")
# The brief's package table, with NVIDIA's version schemes (glm_infra/spec/packages.py): the main repository.
EXPECTED_VERSIONS = {
    "glm-sim-hardware": "1.4-1",
    "pciutils": "1:3.10.0-2glmsim1",
    "glm-sim-rdma-tools": "1.0-1",
    "nvidia-driver-pinning-580": "580-5",
    "nvidia-driver-pinning-580.159.04": "580.159.04-1",
    "nvidia-driver-580-open": "580.159.04-1ubuntu1",
    **{f: "580.159.04-1ubuntu1" for f in FAMILY},
    "libnvidia-nscq": "580.159.04-1",
    "nvidia-fabricmanager": "580.159.04-1",
    "nvlsm": "2025.06.5-1",
    "libnvsdm": "580.159.04-1",
    "libibnetdisc5t64": "50.0-2ubuntu0.2",
    "infiniband-diags": "50.0-2ubuntu0.2",
    "datacenter-gpu-manager-4-cuda13": "1:4.4.1-1",
    "datacenter-gpu-manager-4-core": "1:4.4.1-1",
    "datacenter-gpu-manager-exporter": "4.5.2.001-1",
    "rdma-core": "50.0-2ubuntu0.2",
    "ibverbs-utils": "50.0-2ubuntu0.2",
    f"linux-headers-{KERNEL}": "1.0-1",
    f"linux-modules-extra-{KERNEL}": "1.0-1",
}
# The DOCA repository: DOCA 3.1.0 with its own builds of Ubuntu's rdma packages, a newer DOCA, and the
# simulation's own packages (both repositories carry them).
DOCA_VERSIONS = {
    "doca-ofed": ["3.1.0-091000", "3.99.0-999000"],
    "infiniband-diags": ["2507mlnx56-1", "2599mlnx99-1"],
    "rdma-core": ["2507mlnx56-1", "2599mlnx99-1"],
    "ibverbs-utils": ["2507mlnx56-1", "2599mlnx99-1"],
    "glm-sim-hardware": ["1.4-1"], "glm-sim-rdma-tools": ["1.0-1"], "pciutils": ["1:3.10.0-2glmsim1"],
}
EXPECTED_CONTENTS = {
    "nvidia-utils-580": ["usr/bin/nvidia-smi"],
    "nvidia-compute-utils-580": ["usr/bin/nvidia-persistenced", "lib/systemd/system/nvidia-persistenced.service"],
    "nvidia-dkms-580-open": ["lib/systemd/system/nvidia-sim-module.service", "usr/share/glm-sim/driver-version"],
    "nvidia-kernel-common-580": ["usr/bin/nvidia-modprobe"],
    "nvidia-driver-pinning-580.159.04": ["etc/apt/preferences.d/nvidia-driver-pinning-580.159.04.pref"],
    "nvidia-driver-pinning-580": ["etc/apt/preferences.d/nvidia-driver-pinning-580.pref"],
    "nvidia-fabricmanager": [
        "usr/bin/nv-fabricmanager", "usr/bin/nvidia-fabricmanager-start.sh",
        "lib/systemd/system/nvidia-fabricmanager.service", "usr/share/glm-sim/fabricmanager-version",
    ],
    "nvlsm": ["opt/nvidia/nvlsm/sbin/nvlsm", "usr/share/nvidia/nvlsm/nvlsm.conf"],
    "infiniband-diags": ["usr/sbin/ibstat"],
    "datacenter-gpu-manager-4-core": ["usr/bin/dcgmi", "usr/bin/nv-hostengine", "lib/systemd/system/nvidia-dcgm.service"],
    "glm-sim-rdma-tools": ["usr/bin/ibv_devinfo"],
    "pciutils": ["usr/bin/lspci", "usr/bin/setpci"],
    "glm-sim-hardware": ["etc/glm-sim/hardware.conf", "usr/lib/glm-sim/glm_sim_hw.py", "usr/local/sbin/modprobe",
                         "usr/lib/glm-sim/modules-load", "lib/systemd/system/simulated-modules-load.service"],
    f"linux-headers-{KERNEL}": [f"lib/modules/{KERNEL}/build/Makefile"],
    f"linux-modules-extra-{KERNEL}": [f"lib/modules/{KERNEL}/kernel/drivers/infiniband/core/ib_umad.ko.zst",
                                      f"lib/modules/{KERNEL}/kernel/drivers/infiniband/hw/mlx5/mlx5_ib.ko.zst"],
}


def fixture(name: str) -> str:
    path = FIXTURES / name
    if not path.is_file():
        pytest.skip(f"{path} not beside this checkout")
    return path.read_text()


def misc_section(title: str) -> list[str]:
    """One '== title' section of the fixture misc.txt, as lines."""
    sections = re.split(r"^== (.+)$", fixture("misc.txt"), flags=re.M)
    for name, body in zip(sections[1::2], sections[2::2]):
        if name == title:
            return body.strip("\n").split("\n")
    raise AssertionError(f"misc.txt has no section {title!r}")


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60, **kw)


# --- the repository -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    missing = [t for t in ("dpkg-deb", "dpkg-scanpackages", "gpg", "gpgv") if not shutil.which(t)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    base = tmp_path_factory.mktemp("repo")
    out = base / "apt"
    env = {**os.environ, "GLM_INFRA_CACHE": str(base / "cache")}
    r = run([STANDINS / "build-apt-repo", out], env=env)
    assert r.returncode == 0, r.stderr
    return {"dir": out, "stdout": r.stdout, "env": env, "gnupghome": base / "cache" / "sim" / "gpg"}


def deb(repo, package: str, version: str | None = None, folder: str = "") -> Path:
    version = (version or EXPECTED_VERSIONS[package]).split(":")[-1]
    return repo["dir"] / folder / f"{package}_{version}_all.deb"


def test_build_script_is_shellcheck_clean():
    r = run([SHELLCHECK, "-x", STANDINS / "build-apt-repo"])
    assert r.returncode == 0, r.stdout


def test_shell_scripts_in_the_packages_are_posix_and_shellcheck_clean():
    scripts = [p for p in DEBS.rglob("*") if p.is_file() and p.read_text(errors="replace").startswith("#!/bin/sh")]
    assert len(scripts) >= 10  # maintainer scripts plus the sh daemons
    for script in scripts:
        assert run(["sh", "-n", script]).returncode == 0, script
        r = run([SHELLCHECK, "-s", "sh", script])
        assert r.returncode == 0, r.stdout


def test_every_package_is_built_with_its_version(repo):
    for package, version in EXPECTED_VERSIONS.items():
        path = deb(repo, package)
        assert path.is_file(), f"missing {path.name}"
        fields = run(["dpkg-deb", "-f", path, "Package", "Version", "Architecture", "Maintainer"]).stdout
        assert f"Package: {package}\n" in fields
        assert f"Version: {version}\n" in fields
        assert "Architecture: all\n" in fields
        assert "Maintainer: glm-infra simulated cluster" in fields
        assert f"built {package} {version}" in repo["stdout"]
    for package, versions in DOCA_VERSIONS.items():
        for version in versions:
            assert deb(repo, package, version, "doca").is_file(), (package, version)
    # The other driver releases: a second 580, branch 595 under its renamed packages, and of each branch a
    # release newer than any stack pins.
    others = {
        "580.172.08": ["nvidia-driver-pinning-580.172.08_580.172.08-1", "nvidia-driver-580-open_580.172.08-1ubuntu1",
                       "nvidia-dkms-580-open_580.172.08-1ubuntu1", "nvidia-fabricmanager_580.172.08-1"],
        "580.999.01": ["nvidia-utils-580_580.999.01-1ubuntu1", "libnvidia-nscq_580.999.01-1"],
        "595.71.05": ["nvidia-driver-pinning-595_595-5", "nvidia-driver-pinning-595.71.05_595.71.05-1ubuntu1",
                      "nvidia-driver-open_595.71.05-1ubuntu1", "nvidia-utils_595.71.05-1ubuntu1",
                      "nvidia-compute-utils_595.71.05-1ubuntu1", "nvidia-dkms-open_595.71.05-1ubuntu1",
                      "nvidia-kernel-common_595.71.05-1ubuntu1", "libnvidia-compute_595.71.05-1ubuntu1",
                      "nvidia-fabricmanager_595.71.05-1ubuntu1", "libnvidia-nscq_595.71.05-1ubuntu1",
                      "libnvsdm_595.71.05-1ubuntu1"],
        "595.999.01": ["nvidia-driver-open_595.999.01-1ubuntu1"],
    }
    for names in others.values():
        for name in names:
            assert (repo["dir"] / f"{name}_all.deb").is_file(), name
    # Nothing else: the registry's builds and the simulation's own packages (tests/standins/test_registry_standins).
    main = {p.name for p in repo["dir"].glob("*.deb")}
    assert {deb(repo, p).name for p in EXPECTED_VERSIONS} <= main
    assert not {p.name for p in repo["dir"].glob("*.deb") if "mlnx" in p.name or p.name.startswith("doca-")}


def test_packages_hold_their_tools_owned_by_root(repo):
    for package, paths in EXPECTED_CONTENTS.items():
        listing = run(["dpkg-deb", "--contents", deb(repo, package)]).stdout.splitlines()
        for path in paths:
            line = next((l for l in listing if l.endswith(f" ./{path}")), None)
            assert line, f"{package} lacks /{path}"
            assert " root/root " in line
            if "/bin/" in path or "/sbin/" in path:
                assert line.startswith("-rwxr-xr-x"), line


def test_both_rdma_stacks_get_ibv_devinfo_from_one_shared_package(repo):
    for path in (deb(repo, "doca-ofed", "3.1.0-091000", "doca"), deb(repo, "ibverbs-utils")):
        depends = run(["dpkg-deb", "-f", path, "Depends"]).stdout
        assert "glm-sim-rdma-tools" in depends


def test_version_files_carry_the_upstream_version(repo, tmp_path):
    for package, path in (
        ("nvidia-dkms-580-open", "usr/share/glm-sim/driver-version"),
        ("nvidia-fabricmanager", "usr/share/glm-sim/fabricmanager-version"),
    ):
        run(["dpkg-deb", "-x", deb(repo, package), tmp_path])
        assert (tmp_path / path).read_text().strip() == DRIVER


def test_hardware_conf_is_a_conffile_matching_the_defaults(repo, tmp_path):
    run(["dpkg-deb", "-e", deb(repo, "glm-sim-hardware"), tmp_path / "control"])
    assert (tmp_path / "control" / "conffiles").read_text().split() == ["/etc/glm-sim/hardware.conf"]
    r = run(
        ["python3", "-c", "import glm_sim_hw as h, sys; "
         "print(h.parse_conf(open(sys.argv[1]).read(), 'x') == h.DEFAULTS)",
         DEBS / "glm-sim-hardware/etc/glm-sim/hardware.conf"],
        env={**os.environ, "PYTHONPATH": str(HW_LIB)},
    )
    assert r.stdout.strip() == "True", r.stderr


def test_release_signature_verifies_with_the_exported_key(repo, tmp_path):
    out = repo["dir"]
    keyring = tmp_path / "glm-sim.gpg"
    dearmor = run(["gpg", "--batch", "--dearmor", "--output", keyring, out / "glm-sim-archive.pub"],
                  env={**os.environ, "GNUPGHOME": str(tmp_path)})
    assert dearmor.returncode == 0, dearmor.stderr
    assert run(["gpgv", "--keyring", keyring, out / "InRelease"]).returncode == 0
    assert run(["gpgv", "--keyring", keyring, out / "Release.gpg", out / "Release"]).returncode == 0
    # The signed text is the Release file, and a changed Release no longer verifies.
    assert (out / "Release").read_text() in (out / "InRelease").read_text()
    tampered = tmp_path / "Release"
    tampered.write_text((out / "Release").read_text().replace("glm-sim", "glm-sin"))
    assert run(["gpgv", "--keyring", keyring, out / "Release.gpg", tampered]).returncode != 0


def test_release_describes_the_indexes(repo):
    out = repo["dir"]
    release = (out / "Release").read_text()
    for field in ("Origin: glm-infra", "Label: glm-sim", "Suite: ./", "Architectures: all amd64"):
        assert field + "\n" in release
    assert re.search(r"^Date: \w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} UTC$", release, re.M)
    for algorithm, section in (("md5", "MD5Sum"), ("sha256", "SHA256")):
        block = release.split(f"{section}:\n", 1)[1]
        for name in ("Packages", "Packages.gz"):
            data = (out / name).read_bytes()
            line = f" {hashlib.new(algorithm, data).hexdigest()} {len(data)} {name}\n"
            assert line in block, f"{section} lacks {line!r}"
    packages = (out / "Packages").read_text()
    for package in EXPECTED_VERSIONS:
        assert f"Filename: ./{deb(repo, package).name}\n" in packages
    assert "Filename: ./doca/" not in packages  # each repository indexes its own folder only


def test_rebuilding_unchanged_sources_does_nothing(repo):
    before = {p.name: p.stat().st_mtime_ns for p in repo["dir"].iterdir()}
    r = run([STANDINS / "build-apt-repo", repo["dir"]], env=repo["env"])
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stdout and "built " not in r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in repo["dir"].iterdir()} == before


# --- the tools, against a simulated root ----------------------------------------------------


@pytest.fixture
def sim(tmp_path):
    return Sim(tmp_path)


def bars(line: str) -> list[int]:
    return [i for i, c in enumerate(line) if c in "|+"]


def test_plain_nvidia_smi_has_the_captured_table_layout(sim):
    real = fixture("nvidia-smi.txt").rstrip("\n").split("\n")
    ours = sim.out("nvidia-smi").rstrip("\n").split("\n")
    # Timestamp, 7 header lines, 4 lines per GPU, a blank line, 7 lines of processes.
    assert len(real) == 1 + 7 + 4 * 2 + 1 + 7
    assert len(ours) == 1 + 7 + 4 * 8 + 1 + 7
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", ours[0])
    assert ours[1:8] == real[1:8]  # same driver version, so the header is identical
    assert ours[-8:] == real[-8:]
    for i in range(8):
        for ours_line, real_line in zip(ours[8 + 4 * i : 12 + 4 * i], real[8:12]):
            assert bars(ours_line) == bars(real_line), ours_line
    assert ours[8] == "|   0  NVIDIA B300 SXM6 AC            On  |   00000000:1A:00.0 Off |                    0 |"
    assert re.fullmatch(
        r"\| N/A   \d\dC    P0 +\d+W / 1100W \|       0MiB / 275040MiB \|      0%      Default \|", ours[9]
    )


def q_labels(text: str) -> list[tuple[int, str]]:
    """(indent, label) of every line of one `nvidia-smi -q` GPU section."""
    out = []
    for line in text.split("\n"):
        if line.strip():
            label = line.split(" : ")[0].rstrip() if " : " in line else line.rstrip()
            out.append(((len(line) - len(line.lstrip())) // 4, label.strip()))
    return out


def q_sections(text: str) -> list[str]:
    return re.split(r"^(?=GPU [0-9A-F]{8}:)", text, flags=re.M)


def test_query_has_the_captured_sections_fields_and_order(sim):
    real = q_sections(fixture("nvidia-smi-q.txt"))
    ours = q_sections(sim.out("nvidia-smi", "-q"))
    assert len(ours) == 1 + 8
    assert q_labels(ours[0]) == q_labels(real[0])
    assert q_labels(ours[1])[1:] == q_labels(real[1])[1:]
    assert ours[1].startswith("GPU 00000000:1A:00.0\n") and re.match(r"GPU [0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.0\n", real[1])
    # Values start in the same column, and a section is followed by one blank line.
    value_columns = lambda section: {line.index(" : ") for line in section.split("\n") if " : " in line}
    assert value_columns(ours[1]) == value_columns(real[1]) == {54}
    assert ours[1].endswith("disabled\n\n") and real[1].endswith("disabled\n\n")
    assert "Product Architecture                               : Blackwell\n" in ours[1]
    assert "Attached GPUs                                          : 8\n" in ours[0]
    assert f"GSP Firmware Version                               : {DRIVER}\n" in ours[1]


def xml_paths(gpu: ET.Element) -> list[str]:
    """Element paths of one <gpu>, each once, in document order (clock lists vary in length)."""
    paths: list[str] = []

    def walk(node: ET.Element, prefix: str) -> None:
        for child in node:
            path = f"{prefix}/{child.tag}"
            if path not in paths:
                paths.append(path)
            walk(child, path)

    walk(gpu, "gpu")
    return paths


def test_xml_query_has_the_captured_elements_in_order(sim):
    real = ET.fromstring(fixture("nvidia-smi-q.xml").split("\n", 2)[2])
    text = sim.out("nvidia-smi", "-q", "-x")
    assert text.split("\n")[:2] == fixture("nvidia-smi-q.xml").split("\n")[:2]
    ours = ET.fromstring(text.split("\n", 2)[2])
    assert [c.tag for c in ours][:4] == [c.tag for c in real][:4]
    assert len(ours.findall("gpu")) == 8
    assert xml_paths(ours.find("gpu")) == xml_paths(real.find("gpu"))
    gpu = ours.find("gpu")
    assert gpu.get("id") == "00000000:1A:00.0"
    assert gpu.findtext("product_name") == "NVIDIA B300 SXM6 AC"
    assert gpu.findtext("fb_memory_usage/total") == "275040 MiB"


def test_query_gpu_csv_has_the_captured_header_and_columns(sim):
    header, *rows = fixture("query-gpu.csv").strip().split("\n")
    fields = re.sub(r" \[[^]]+\]", "", header).replace(" ", "")
    ours_header, *ours_rows = sim.out("nvidia-smi", f"--query-gpu={fields}", "--format=csv").strip().split("\n")
    assert ours_header == header
    assert len(ours_rows) == 8
    real_cells = rows[0].split(", ")
    units = [c.split(" ")[-1] if c.split(" ")[-1] in ("MiB", "MHz", "W") else None for c in real_cells]
    for row in ours_rows:
        cells = row.split(", ")
        assert len(cells) == len(real_cells)
        assert [c.split(" ")[-1] if u else None for c, u in zip(cells, units)] == units
    first = ours_rows[0].split(", ")
    assert first[1] == "NVIDIA B300 SXM6 AC" and first[5] == "275040 MiB" and first[7] == "10.3"
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", first[2])
    bare = sim.out("nvidia-smi", "--query-gpu=count,memory.total,remapped_rows.pending", "--format=csv,noheader,nounits")
    assert bare.split("\n")[0] == "8, 275040, No"


def test_uuids_are_stable_and_differ_per_gpu(sim):
    first, again = sim.out("nvidia-smi", "-L"), sim.out("nvidia-smi", "-L")
    assert first == again
    uuids = re.findall(r"UUID: (GPU-[0-9a-f-]+)", first)
    assert len(set(uuids)) == 8


def test_remapped_rows_csv_has_the_captured_layout_and_shows_pending(sim):
    real_header, real_row, *_ = misc_section("remapped")
    fields = real_header.replace(" ", "")
    sim.fault(REMAPPED_PENDING="2")
    header, *rows = sim.out("nvidia-smi", f"--query-remapped-rows={fields}", "--format=csv").strip().split("\n")
    assert header == real_header
    assert len(rows) == 8 and all(len(r.split(", ")) == len(real_row.split(", ")) for r in rows)
    assert rows[0] == "00000000:1A:00.0, 0, 0, No, No"
    assert rows[2].startswith("00000000:62:00.0, ") and rows[2].split(", ")[3] == "Yes"
    sections = q_sections(sim.out("nvidia-smi", "-q"))
    remap = lambda section: re.search(r"Remapped Rows\n(?:        .*\n)*?        Pending +: (\w+)", section)[1]
    assert [remap(s) for s in sections[1:]] == ["No", "No", "Yes", "No", "No", "No", "No", "No"]


GPU_LINE = re.compile(r"GPU \d+: .+ \(UUID: GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\)")
LINK_LINE = re.compile(r"\t Link \d+: \d+\.\d{3} GB/s")


def test_list_and_nvlink_status_have_the_captured_line_format(sim):
    real = misc_section("nvlink -s")
    # The patterns describe the capture: a GPU line, then its 18 links.
    assert [bool(GPU_LINE.fullmatch(l)) for l in real] == ([True] + [False] * 18) * 2
    assert all(LINK_LINE.fullmatch(l) for i, l in enumerate(real) if i % 19)
    listed = sim.out("nvidia-smi", "-L").strip().split("\n")
    assert len(listed) == 8 and all(GPU_LINE.fullmatch(l) for l in listed)
    status = sim.out("nvidia-smi", "nvlink", "-s").strip().split("\n")
    assert len(status) == 8 * 19
    assert status[::19] == listed
    assert all(LINK_LINE.fullmatch(l) and l.endswith(": 53.125 GB/s") for i, l in enumerate(status) if i % 19)
    assert [l.split(":")[0] for l in status[1:19]] == [l.split(":")[0] for l in real[1:19]]
    assert sim.out("nvidia-smi", "nvlink", "--status", "-i", "1").split("\n")[0] == listed[1]


def test_down_nvlinks_show_inactive_like_the_real_tool(sim):
    sim.fault(NVLINK_DOWN="0:3 0:17 5:0")
    status = sim.out("nvidia-smi", "nvlink", "-s").split("\n")
    inactive = [(i // 19, l) for i, l in enumerate(status) if "<inactive>" in l]
    assert inactive == [(0, "\t Link 3: <inactive>"), (0, "\t Link 17: <inactive>"), (5, "\t Link 0: <inactive>")]
    assert status[1] == "\t Link 0: 53.125 GB/s"
    topo = sim.out("nvidia-smi", "topo", "-m").split("\n")
    assert topo[1].split("\t")[2] == "NV16" and topo[2].split("\t")[3] == "NV18" and topo[6].split("\t")[1] == "NV16"


def test_topology_matrix_has_the_captured_layout(sim):
    real = misc_section("topo -m")
    ours = sim.out("nvidia-smi", "topo", "-m").rstrip("\n").split("\n")
    columns = [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(9)]
    tail = real[0].split("\t")[-3:]  # CPU Affinity, NUMA Affinity, GPU NUMA ID and the end of the underline
    assert real[0].startswith("\t\x1b[4mGPU0\t") and tail[-1].endswith("\x1b[0m")
    assert ours[0] == "\t\x1b[4m" + "\t".join(columns + tail)
    real_row_tail = len(real[1].split("\t")) - 1 - 2  # fields after the cells of 2 GPUs
    cpu_list = re.compile(r"\d+-\d+(,\d+-\d+)*")
    assert cpu_list.fullmatch(real[1].split("\t")[-4])
    for i in range(8):
        cells = ours[1 + i].split("\t")
        assert cells[0] == f"GPU{i}" and cells[1 + i] == " X " and len(cells) == 1 + 17 + real_row_tail
        assert cells[-2:] == ["", "N/A"] and cells[-3] == str(i // 4) and cpu_list.fullmatch(cells[-4])
    for i in range(9):
        cells = ours[9 + i].split("\t")
        assert cells[0] == f"NIC{i}" and cells[9 + i] == " X " and cells[-real_row_tail:] == [""] * real_row_tail
    # Each GPU to each compute NIC as on a real HGX B300 (its NICs are mlx5_10..17 there, mlx5_0..7 here):
    # PXB to its own ConnectX-8 (behind the NIC's own PCIe switch), NODE on its socket, SYS across.
    b300 = hostcheck.parse_topo_m(B300_TOPO.read_text())
    mine = hostcheck.parse_topo_m("\n".join(ours))
    assert {g: {f"mlx5_{i}": b300[g][f"mlx5_{10 + i}"] for i in range(8)} for g in b300} == \
        {g: {n: d for n, d in row.items() if n != "mlx5_8"} for g, row in mine.items()}
    legend = real[real.index("Legend:") :]
    assert ours[18:19] == [""] and ours[19 : 19 + len(legend)] == legend
    assert ours[19 + len(legend) :] == ["", "NIC Legend:", ""] + [f"  NIC{i}: mlx5_{i}" for i in range(9)]


def test_a_nic_moved_away_from_its_gpu_shows_in_the_matrix(sim):
    sim.fault(NIC_DISTANCE="3:SYS 5:PIX")
    topo = hostcheck.parse_topo_m(sim.out("nvidia-smi", "topo", "-m"))
    assert topo[3]["mlx5_3"] == "SYS" and topo[5]["mlx5_5"] == "PIX" and topo[0]["mlx5_0"] == "PXB"
    assert topo[3]["mlx5_0"] == "NODE", "the others keep their places"
    sim.fault(NIC_DISTANCE="3:FAR")
    r = sim.run("nvidia-smi", "topo", "-m")
    assert r.returncode == 255 and "NIC_DISTANCE entries are gpu:level" in r.stderr and "'3:FAR'" in r.stderr


def test_gpu_count_hides_gpus_everywhere(sim):
    sim.fault(GPU_COUNT="7")
    assert len(sim.out("nvidia-smi", "-L").strip().split("\n")) == 7
    assert sim.out("nvidia-smi").count("NVIDIA B300 SXM6 AC") == 7
    assert sim.out("nvidia-smi", "--query-gpu=count", "--format=csv,noheader").split("\n")[0] == "7"
    assert "Attached GPUs                                          : 7\n" in sim.out("nvidia-smi", "-q")
    assert list(diag_table(sim.out("dcgmi", "diag", "-r", "1"))["software"]["gpus"]) == list(range(7))


def fabric(sim: Sim) -> tuple[str, str]:
    text = sim.out("nvidia-smi", "-q", "-i", "0")
    m = re.search(r"    Fabric\n        State +: (.+)\n        Status +: (.+)\n", text)
    return m[1], m[2]


def test_fabric_completes_only_with_the_fabric_manager_running_at_the_driver_version(sim):
    assert fabric(sim) == ("Completed", "Success")
    (sim.root / "run/glm-sim/fabricmanager-active").unlink()
    assert fabric(sim) == ("In Progress", "N/A")
    sim.write("run/glm-sim/fabricmanager-active", "")
    sim.write("usr/share/glm-sim/fabricmanager-version", "580.126.09")
    assert fabric(sim) == ("In Progress", "N/A")
    xml = ET.fromstring(sim.out("nvidia-smi", "-q", "-x").split("\n", 2)[2])
    assert {g.findtext("fabric/state") for g in xml.findall("gpu")} == {"In Progress"}
    sim.fault(FABRIC_STATE="Completed")
    assert fabric(sim) == ("Completed", "Success")


def test_a_failed_fabric_registration_reads_as_nvml_reports_it(sim):
    """FABRIC_STATUS: the Status of a registration that completed and failed (NVML sets it only once the
    State is Completed), in -q and -q -x, with CliqueId 0 and a zero ClusterUUID as a field report of
    one shows them (Azure/azhpc-images pull request 506); before Completed the Status reads N/A."""
    sim.fault(FABRIC_STATUS="Insufficient Resources")
    assert fabric(sim) == ("Completed", "Insufficient Resources")
    text = sim.out("nvidia-smi", "-q")
    assert text.count("        Status                                         : Insufficient Resources\n") == 8
    assert re.search(r"        CliqueId +: 0\n        ClusterUUID +: 00000000-0000-0000-0000-000000000000\n", text)
    xml = ET.fromstring(sim.out("nvidia-smi", "-q", "-x").split("\n", 2)[2])
    assert {(g.findtext("fabric/state"), g.findtext("fabric/status")) for g in xml.findall("gpu")} == {
        ("Completed", "Insufficient Resources")}
    (sim.root / "run/glm-sim/fabricmanager-active").unlink()
    assert fabric(sim) == ("In Progress", "N/A")
    sim.fault(FABRIC_STATE="Completed", FABRIC_STATUS="Failure")
    assert fabric(sim) == ("Completed", "Failure")


def test_no_loaded_driver_fails_like_the_real_tool(sim):
    (sim.root / "run/glm-sim/loaded-driver-version").unlink()
    for args in ([], ["-L"], ["-q"], ["--query-gpu=name", "--format=csv"], ["nvlink", "-s"], ["topo", "-m"]):
        r = sim.run("nvidia-smi", *args)
        assert r.returncode == 9
        assert r.stdout.startswith(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n"
        )


def test_driver_library_mismatch_fails_like_the_real_tool(sim):
    sim.write("usr/share/glm-sim/driver-version", "580.172.08")  # upgraded, not yet rebooted
    r = sim.run("nvidia-smi")
    assert r.returncode == 18
    # NVML names only major.minor of its own (installed) version.
    assert r.stdout == "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.172\n"


def test_bad_queries_and_config_fail(sim):
    r = sim.run("nvidia-smi", "--query-gpu=index,bogus", "--format=csv")
    assert r.returncode == 2 and r.stdout == 'Field "bogus" is not a valid field to query.\n'
    sim.fault(NVLINK_DOWNN="0:1")
    r = sim.run("nvidia-smi", "-L")
    assert r.returncode != 0 and "unknown key NVLINK_DOWNN" in r.stderr


DEVINFO_DEVICE = re.compile(
    r"hca_id:\t(\S+)\n"
    r"\ttransport:\t\t\tInfiniBand \(0\)\n"
    r"\tfw_ver:\t\t\t\t[\d.]+\n"
    r"\tnode_guid:\t\t\t[0-9a-f]{4}(?::[0-9a-f]{4}){3}\n"
    r"\tsys_image_guid:\t\t\t[0-9a-f]{4}(?::[0-9a-f]{4}){3}\n"
    r"\tvendor_id:\t\t\t0x[0-9a-f]{4}\n"
    r"\tvendor_part_id:\t\t\t\d+\n"
    r"\thw_ver:\t\t\t\t0x[0-9A-F]+\n"
    r"\tboard_id:\t\t\t\S+\n"
    r"\tphys_port_cnt:\t\t\t1\n"
    r"\t\tport:\t1\n"
    r"\t\t\tstate:\t\t\t(PORT_\w+) \((\d)\)\n"
    r"\t\t\tmax_mtu:\t\t4096 \(5\)\n"
    r"\t\t\tactive_mtu:\t\t(\d+) \((\d)\)\n"
    r"\t\t\tsm_lid:\t\t\t\d+\n"
    r"\t\t\tport_lid:\t\t\d+\n"
    r"\t\t\tport_lmc:\t\t0x00\n"
    r"\t\t\tlink_layer:\t\t(Ethernet|InfiniBand)\n"
    r"\n"
)


def devinfo(sim: Sim, *args: str) -> list[tuple[str, ...]]:
    """ibv_devinfo parsed with devinfo.c's printf layout; fails on any stray line."""
    text = sim.out("ibv_devinfo", *args)
    devices = [m.groups() for m in DEVINFO_DEVICE.finditer(text)]
    assert "".join(m.group(0) for m in DEVINFO_DEVICE.finditer(text)) == text
    return devices


def test_ibv_devinfo_lists_compute_roce_nics_and_the_infiniband_management_nic(sim):
    devices = devinfo(sim)
    assert [d[0] for d in devices] == [f"mlx5_{i}" for i in range(9)]
    for name, state, state_code, mtu, mtu_code, link in devices[:8]:
        assert (state, state_code, mtu, mtu_code, link) == ("PORT_ACTIVE", "4", "4096", "5", "Ethernet")
    assert devices[8][1:] == ("PORT_ACTIVE", "4", "4096", "5", "InfiniBand")
    assert devinfo(sim, "-d", "mlx5_8")[0][0] == "mlx5_8"
    assert sim.out("ibv_devinfo", "-l") == "9 HCAs found:\n" + "".join(f"\tmlx5_{i}\n" for i in range(9)) + "\n"


def test_rdma_faults_show_in_ibv_devinfo(sim):
    sim.fault(RDMA_DOWN="mlx5_3", RDMA_MTU="1024")
    devices = {d[0]: d for d in devinfo(sim)}
    assert devices["mlx5_3"][1:3] == ("PORT_DOWN", "1")
    assert all(d[1] == "PORT_ACTIVE" for n, d in devices.items() if n != "mlx5_3")
    assert devices["mlx5_0"][3:5] == ("1024", "3")
    assert devices["mlx5_8"][3] == "4096"  # the management NIC is not a RoCE NIC


def test_show_gids_prints_the_mlnx_script_table(sim):
    lines = sim.out("show_gids").rstrip("\n").split("\n")
    assert lines[:2] == [
        "DEV\tPORT\tINDEX\tGID\t\t\t\t\tIPv4  \t\tVER\tDEV",
        "---\t----\t-----\t---\t\t\t\t\t------------  \t---\t---",
    ]
    assert lines[-1] == f"n_gids_found={len(lines) - 3}" == "n_gids_found=33"
    gid = r"[0-9a-f]{4}(?::[0-9a-f]{4}){7}"
    mlx5_0 = [l for l in lines if l.startswith("mlx5_0\t")]
    assert [l.split("\t")[2] for l in mlx5_0] == ["0", "1", "2", "3"]
    assert re.fullmatch(rf"mlx5_0\t1\t0\tfe80:0000:0000:0000(?::[0-9a-f]{{4}}){{4}}\t\t\tv1\tens1f0np0", mlx5_0[0])
    m = re.fullmatch(rf"mlx5_0\t1\t3\t({gid})\t(\d+\.\d+\.\d+\.\d+)  \tv2\tens1f0np0", mlx5_0[3])
    assert m, mlx5_0[3]
    # The IPv4 column is the address the IPv4-mapped GID holds.
    assert m[1].startswith("0000:0000:0000:0000:0000:ffff:")
    assert m[2] == ".".join(str(b) for b in bytes.fromhex(m[1][30:].replace(":", "")))
    assert re.fullmatch(rf"mlx5_8\t1\t0\tfe80:0000:0000:0000(?::[0-9a-f]{{4}}){{4}}\t\t\tv1\t", lines[-2])
    assert sim.out("show_gids", "mlx5_2").count("\nmlx5_2\t") == 4


def test_ibdev2netdev_maps_devices_to_netdevs(sim):
    sim.fault(RDMA_DOWN="mlx5_5")
    lines = sim.out("ibdev2netdev").strip().split("\n")
    assert lines[0] == "mlx5_0 port 1 ==> ens1f0np0 (Up)"
    assert lines[5] == "mlx5_5 port 1 ==> ens6f0np0 (Down)"
    assert re.fullmatch(r"mlx5_8 port 1 ==> ib\w+ \(Up\)", lines[8])


def test_ibstat_prints_ibstat_c_layout(sim):
    sim.fault(RDMA_DOWN="mlx5_8")
    text = sim.out("ibstat", "mlx5_8")
    assert re.fullmatch(
        r"CA 'mlx5_8'\n\tCA type: MT\d+\n\tNumber of ports: 1\n\tFirmware version: [\d.]+\n"
        r"\tHardware version: \d+\n\tNode GUID: 0x[0-9a-f]{16}\n\tSystem image GUID: 0x[0-9a-f]{16}\n"
        r"\tPort 1:\n\t\tState: Down\n\t\tPhysical state: Polling\n\t\tRate: \d+\n\t\tBase lid: \d+\n"
        r"\t\tLMC: 0\n\t\tSM lid: \d+\n\t\tCapability mask: 0x[0-9a-f]{8}\n\t\tPort GUID: 0x[0-9a-f]{16}\n"
        r"\t\tLink layer: InfiniBand\n",
        text,
    ), text
    assert "\t\tLink layer: Ethernet\n" in sim.out("ibstat", "mlx5_0")
    assert sim.out("ibstat", "-l").split() == [f"mlx5_{i}" for i in range(9)]


# --- the RDMA stand-ins against real captures (tests/fixtures/rdma, each citing its source) ---------

RDMA_FIXTURES = ROOT / "tests" / "fixtures" / "rdma"


def shape(line: str) -> str:
    """A line with its values taken out: the indentation, the key and the separators stay."""
    m = re.match(r"^(\s*)([^:\t]+?)(:[ \t]*)(.*)$", line)
    if not m:
        return re.sub(r"\S+", "V", line)
    key = re.sub(r"GID\[\s*\d+\]", "GID[n]", m.group(2))
    return f"{m.group(1)}{key}{m.group(3)}{'V' if m.group(4) else ''}"


def blocks(text: str, start: str) -> list[list[str]]:
    """The text cut into blocks, each beginning with a line that starts with ``start``."""
    out: list[list[str]] = []
    for line in text.rstrip("\n").split("\n"):
        if line.startswith(start):
            out.append([])
        if out:
            out[-1].append(line)
    for block in out:  # the blank line between blocks belongs to neither
        while block and not block[-1]:
            block.pop()
    return out


def test_ibv_devinfo_has_the_real_layout(sim):
    real = blocks((RDMA_FIXTURES / "ibv_devinfo-1.txt").read_text(), "hca_id:")  # ConnectX-7, tabs kept
    ours = blocks(sim.out("ibv_devinfo"), "hca_id:")
    assert [shape(l) for l in ours[8]] == [shape(l) for l in real[0]], "an InfiniBand device, line for line"
    assert [shape(l) for l in ours[0]] == [shape(l) for l in real[0]], "a RoCE device has the same lines"


def test_ibv_devinfo_verbose_has_the_real_layout(sim):
    real_ib = blocks((RDMA_FIXTURES / "ibv_devinfo-v-1.txt").read_text(), "hca_id:")[0]  # tabs kept
    ours = blocks(sim.out("ibv_devinfo", "-v"), "hca_id:")
    assert [shape(l) for l in ours[8]] == [shape(l) for l in real_ib], "device caps, port attributes, GID line"
    # RoCE: the real capture (tabs expanded) gives the keys in order and the GID lines' form.
    real_roce = (RDMA_FIXTURES / "ibv_devinfo-v-2.txt").read_text()
    def port_keys(text: str) -> list[str]:
        port = re.split(r"\n\s*port:\s", text, maxsplit=1)[1]
        return [shape(l).strip().rstrip("V").rstrip(": \t") for l in port.split("\n")[1:] if l.strip()]

    real_keys, our_keys = port_keys(real_roce), port_keys("\n".join(ours[0]))
    assert [k for k in our_keys if k != "GID[n]"] == [k for k in real_keys if k != "GID[n]"]
    gid_lines = [l.strip() for l in ours[0] if "GID[" in l]
    assert len(gid_lines) == 4
    assert re.fullmatch(r"GID\[  0\]:\t\tfe80(:[0-9a-f]{4}){7}, RoCE v1", gid_lines[0])
    assert re.fullmatch(r"GID\[  1\]:\t\tfe80::[0-9a-f:]+, RoCE v2", gid_lines[1]), "v2 through inet_ntop"
    assert re.fullmatch(r"GID\[  2\]:\t\t0000:0000:0000:0000:0000:ffff(:[0-9a-f]{4}){2}, RoCE v1", gid_lines[2])
    assert re.fullmatch(r"GID\[  3\]:\t\t::ffff:\d+\.\d+\.\d+\.\d+, RoCE v2", gid_lines[3]), "as inet_ntop prints it"
    for real in re.findall(r"GID\[\s*\d+\]:\s+(.*)", real_roce):
        assert re.fullmatch(r"[0-9a-f:.]+, RoCE v[12]", real)


def test_show_gids_has_the_real_layout(sim):
    real = (RDMA_FIXTURES / "show_gids-1.txt").read_text().rstrip("\n").split("\n")  # tabs kept
    ours = sim.out("show_gids", "mlx5_0").rstrip("\n").split("\n")
    assert ours[:2] == real[:2], "header and rule"
    tabs = lambda line: re.sub(r"[^\t ]+", "V", line)
    assert [tabs(l) for l in ours[2:-1]] == [tabs(l) for l in real[2:-1]], "rows: same columns, same spacing"
    assert re.fullmatch(r"n_gids_found=\d+", real[-1]) and ours[-1] == "n_gids_found=4"


def test_ibstat_has_the_real_layout(sim):
    real = blocks((RDMA_FIXTURES / "ibstat-1.txt").read_text(), "CA '")  # tabs kept
    ours = blocks(sim.out("ibstat"), "CA '")
    assert [shape(l) for l in ours[0]] == [shape(l) for l in real[0]]
    real_ib = blocks((RDMA_FIXTURES / "ibstat-2.txt").read_text(), "CA '")[0]
    assert [shape(l) for l in ours[8]] == [shape(l) for l in real_ib]


def test_ib_write_bw_reports_the_configured_bandwidth_in_perftest_format(sim):
    sim.fault(RDMA_BW_GBPS="391.50")
    text = sim.out("ib_write_bw", "-d", "mlx5_1", "-x", "3", "-F", "--report_gbits", "-s", "1048576",
                   "--use_cuda=1", "10.101.0.7")
    lines = text.rstrip("\n").split("\n")
    header = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
    assert header in lines and lines[-1] == "-" * 87
    row = lines[lines.index(header) + 1]
    assert re.fullmatch(r" 1048576    \d+ +[\d.]+ +391\.50 *\t\t   [\d.]+", row), row
    assert " Link type       : Ethernet" in lines and " GID index       : 3" in lines
    assert " Dual-port       : OFF\t\tDevice         : mlx5_1" in lines
    assert " GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:101:00:07" in lines
    assert "BW average[MB/sec]" in sim.out("ib_write_bw", "-d", "mlx5_0", "10.100.0.9")


def test_ib_write_bw_fails_on_a_down_port(sim):
    sim.fault(RDMA_DOWN="mlx5_4")
    r = sim.run("ib_write_bw", "-d", "mlx5_4", "--report_gbits", "10.104.0.2")
    assert r.returncode != 0
    assert " Port number 1 state is Down\n Couldn't set the link layer\n" in r.stderr


METADATA = ("DCGM Version", "Driver Version Detected", "GPU Device IDs Detected")
GPU_RESULT = re.compile(r"GPU(\d+): (Pass|Fail|Skip|Warn)")


def diag_table(text: str) -> dict[str, dict]:
    """dcgmi diag output as test -> {result, gpus: {index: result}, warnings: {index: message}},
    after checking that every table line has dcgmi's width and column borders."""
    lines = text.rstrip("\n").split("\n")
    assert lines[0] == "Successfully ran diagnostic for group."
    assert all(len(l) == 78 and l[0] in "|+" and l[28] in "|+" and l[-1] in "|+" for l in lines[1:]), text
    tests: dict[str, dict] = {}
    warned_gpu = None
    for line in lines[4:-1]:
        if line.startswith(("|-----", "+-----")):
            continue
        name, chunk = line[2:27].rstrip(), line[30:75]  # dcgmi wraps messages every 45 characters
        if name in METADATA:
            continue
        if name.startswith("Warning: GPU"):
            warned_gpu = int(name[len("Warning: GPU") :])
            test["warnings"][warned_gpu] = chunk
        elif name:
            test = tests[name] = {"result": chunk.rstrip(), "gpus": {}, "warnings": {}}
        elif GPU_RESULT.fullmatch(chunk.rstrip()):
            gpu, result = GPU_RESULT.fullmatch(chunk.rstrip()).groups()
            test["gpus"][int(gpu)] = result
        else:
            test["warnings"][warned_gpu] += chunk
    for test in tests.values():
        test["warnings"] = {gpu: message.rstrip() for gpu, message in test["warnings"].items()}
    return tests


def test_dcgmi_diag_runs_each_level_and_passes(sim):
    expected = {
        "1": ["software"],
        "2": ["software", "memory", "pcie"],
        "3": ["software", "memory", "diagnostic", "nvbandwidth", "pcie",
              "memory_bandwidth", "targeted_stress", "targeted_power"],
    }
    for level, names in expected.items():
        r = sim.run("dcgmi", "diag", "-r", level)
        assert r.returncode == 0, r.stdout
        tests = diag_table(r.stdout)
        assert list(tests) == names
        for test in tests.values():
            assert test == {"result": "Pass", "gpus": {i: "Pass" for i in range(8)}, "warnings": {}}
        assert f"| Driver Version Detected   | {DRIVER:<46} |" in r.stdout
        assert "| GPU Device IDs Detected   | 3182, 3182, 3182, 3182, 3182, 3182, 3182, 3182 |" in r.stdout
    assert "+-----  Stress  ------------+" in sim.out("dcgmi", "diag", "-r", "3")


def test_dcgmi_diag_fails_the_named_gpus_and_exits_non_zero(sim):
    sim.fault(DCGM_FAIL="3")
    r = sim.run("dcgmi", "diag", "-r", "2")
    assert r.returncode != 0
    tests = diag_table(r.stdout)
    for name in ("software", "memory", "pcie"):
        assert tests[name]["result"] == "Fail"
        assert tests[name]["gpus"] == {i: "Fail" if i == 3 else "Pass" for i in range(8)}
        assert list(tests[name]["warnings"]) == [3]
    sim.fault(DCGM_FAIL="6:memory")
    r = sim.run("dcgmi", "diag", "-r", "2")
    assert r.returncode != 0
    tests = diag_table(r.stdout)
    assert tests["software"]["result"] == "Pass" and tests["pcie"]["result"] == "Pass"
    assert tests["memory"]["result"] == "Fail" and tests["memory"]["gpus"][6] == "Fail"
    assert "A memory mismatch was detected on GPU 6" in tests["memory"]["warnings"][6]


def test_dcgmi_software_test_fails_on_a_pending_row_remap(sim):
    sim.fault(REMAPPED_PENDING="4")
    tests = diag_table(sim.run("dcgmi", "diag", "-r", "1").stdout)
    assert tests["software"]["gpus"][4] == "Fail"
    assert tests["software"]["warnings"][4].startswith("GPU 4 had memory errors and row remappings are pending")


def test_dcgmi_without_a_driver_cannot_start_its_host_engine(sim):
    (sim.root / "run/glm-sim/loaded-driver-version").unlink()
    r = sim.run("dcgmi", "diag", "-r", "1")
    assert r.returncode != 0 and r.stdout.startswith("Error: Unable to start an embedded host engine.")


# --- the simulated kernel module and fabric manager -----------------------------------------


def postinst(sim: Sim, tmp_path: Path, booted: bool, package: str = "nvidia-dkms") -> subprocess.CompletedProcess:
    """Run a stand-in's postinst against the sim root with a recording systemctl."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "systemctl").write_text('#!/bin/sh\necho "systemctl $*" >> "$SYSTEMCTL_LOG"\n')
    (stub / "systemctl").chmod(0o755)
    if booted:
        (sim.root / "run/systemd/system").mkdir(parents=True, exist_ok=True)
    (tmp_path / "systemctl.log").write_text("")
    env = {"PATH": f"{stub}:/usr/bin:/bin", "GLM_SIM_ROOT": str(sim.root), "SYSTEMCTL_LOG": str(tmp_path / "systemctl.log")}
    return run(["sh", DEBS / package / "DEBIAN/postinst", "configure"], env=env)


def headers(sim: Sim) -> None:
    (sim.root / "lib/modules" / KERNEL / "build").mkdir(parents=True)


def test_driver_postinst_loads_the_module_on_a_fresh_install(sim, tmp_path):
    headers(sim)
    (sim.root / "run/glm-sim/loaded-driver-version").unlink()
    r = postinst(sim, tmp_path, booted=False)
    assert r.returncode == 0, r.stderr
    assert (sim.root / "run/glm-sim/loaded-driver-version").read_text().strip() == DRIVER
    assert (tmp_path / "systemctl.log").read_text().splitlines() == ["systemctl --quiet enable nvidia-sim-module.service"]
    assert sim.run("nvidia-smi").returncode == 0


def test_driver_postinst_keeps_the_old_module_loaded_on_an_upgrade(sim, tmp_path):
    headers(sim)
    sim.write("run/glm-sim/loaded-driver-version", "580.126.09")
    r = postinst(sim, tmp_path, booted=True)
    assert r.returncode == 0, r.stderr
    assert (sim.root / "run/glm-sim/loaded-driver-version").read_text().strip() == "580.126.09"
    assert "systemctl daemon-reload" in (tmp_path / "systemctl.log").read_text()
    assert sim.run("nvidia-smi").returncode == 18  # until the reboot


def test_dkms_built_modules_fail_to_configure_without_the_kernels_headers(sim, tmp_path):
    """As DKMS: the driver's module and DOCA's are built against /lib/modules/$(uname -r)/build."""
    (sim.root / "run/glm-sim/loaded-driver-version").unlink()
    for package in ("nvidia-dkms", "doca-ofed"):
        r = postinst(sim, tmp_path, booted=False, package=package)
        assert r.returncode == 21, package
        assert f"Error! Your kernel headers for kernel {KERNEL} cannot be found at /lib/modules/{KERNEL}/build" in r.stderr
    assert not (sim.root / "run/glm-sim/loaded-driver-version").exists()  # nothing was built
    headers(sim)
    assert postinst(sim, tmp_path, booted=False, package="doca-ofed").returncode == 0


def test_module_unit_loads_the_installed_driver_at_boot():
    unit = (DEBS / "nvidia-dkms/lib/systemd/system/nvidia-sim-module.service").read_text()
    assert "Type=oneshot" in unit and "WantedBy=multi-user.target" in unit
    assert "ExecStart=/bin/cp /usr/share/glm-sim/driver-version /run/glm-sim/loaded-driver-version" in unit


def test_fabric_manager_runs_only_at_the_loaded_driver_version(sim):
    sim.write("usr/share/glm-sim/fabricmanager-version", "580.126.09")
    r = sim.run("nv-fabricmanager")
    assert r.returncode == 1 and "does not match" in r.stderr
    sim.write("usr/share/glm-sim/fabricmanager-version", DRIVER)
    with pytest.raises(subprocess.TimeoutExpired):  # it stays up
        subprocess.run(
            [TOOLS["nv-fabricmanager"]], env={**os.environ, "GLM_SIM_ROOT": str(sim.root)}, timeout=1,
            capture_output=True,
        )


# --- persistence mode, the simulated kernel's modules, the DCGM host engine -----------------------


def persistence(sim: Sim) -> tuple[str, str]:
    """(nvidia-smi -q's Persistence Mode, the plain table's Persistence-M) of GPU 0."""
    q = re.search(r"^    Persistence Mode +: (\w+)$", sim.out("nvidia-smi", "-q"), re.M)[1]
    return q, sim.out("nvidia-smi").split("\n")[8].split("|")[1].split()[-1]


def test_ubuntus_persistence_daemon_leaves_persistence_mode_off_until_told(sim, tmp_path):
    """Ubuntu's unit runs the daemon with --no-persistence-mode: started as it ships, the GPUs have persistence
    mode off; with --persistence-mode (glm-infra's drop-in), or nvidia-smi -pm 1, on."""
    unit = (DEBS / "nvidia-compute-utils/lib/systemd/system/nvidia-persistenced.service").read_text()
    assert "ExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced --no-persistence-mode --verbose" in unit
    sections = re.findall(r"^\[(\w+)\]$", unit, re.M)
    assert sections == ["Unit", "Service"] and "StopWhenUnneeded=true" in unit and "Type=forking" in unit  # static
    daemon = DEBS / "nvidia-compute-utils/usr/bin/nvidia-persistenced"
    env = {**os.environ, "GLM_SIM_ROOT": str(sim.root)}
    pid_file = sim.root / "var/run/nvidia-persistenced/nvidia-persistenced.pid"
    try:
        r = run(["sh", daemon, "--user", "nvidia-persistenced", "--no-persistence-mode", "--verbose"], env=env)
        assert r.returncode == 0, r.stderr  # forked: the unit is Type=forking
        assert persistence(sim) == ("Disabled", "Off")
        assert sim.out("nvidia-smi", "--query-gpu=persistence_mode", "--format=csv,noheader").split() == ["Disabled"] * 8
        assert sim.out("nvidia-smi", "-pm", "1").endswith("All done.\n")
        assert persistence(sim) == ("Enabled", "On")
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        run(["sh", daemon, "--user", "nvidia-persistenced", "--persistence-mode"], env=env)
        assert persistence(sim) == ("Enabled", "On")
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_simulated_kernel_loads_a_module_only_when_a_package_ships_it(sim, tmp_path):
    """The stand-in modprobe: ib_umad is loaded (marked under /run/glm-sim/modules) only with linux-modules-extra's
    file for the running kernel; anything else goes to the real modprobe. At boot, modules-load.d is read."""
    shim = DEBS / "glm-sim-hardware/usr/local/sbin/modprobe"
    real = tmp_path / "real-modprobe"
    real.write_text('#!/bin/sh\necho "modprobe: FATAL: Module $1 not found in directory /lib/modules/$(uname -r)" >&2\nexit 1\n')
    real.chmod(0o755)
    env = {**os.environ, "GLM_SIM_ROOT": str(sim.root), "GLM_SIM_REAL_MODPROBE": str(real)}
    r = run(["sh", shim, "ib_umad"], env=env)
    assert r.returncode == 1 and "Module ib_umad not found" in r.stderr
    assert not (sim.root / "run/glm-sim/modules/ib_umad").exists()
    extra = sim.root / "lib/modules" / KERNEL / "kernel/drivers/infiniband"
    (extra / "core").mkdir(parents=True)
    (extra / "core/ib_umad.ko.zst").touch()
    assert run(["sh", shim, "-q", "ib-umad"], env=env).returncode == 0
    assert (sim.root / "run/glm-sim/modules/ib_umad").exists()
    assert run(["sh", shim, "mlx5_ib"], env=env).returncode == 1  # not shipped here
    # At boot: what modules-load.d lists (systemd-modules-load skips containers).
    (sim.root / "run/glm-sim/modules/ib_umad").unlink()
    (sim.root / "etc/modules-load.d").mkdir(parents=True)
    (sim.root / "etc/modules-load.d/glm-infra-nvlink.conf").write_text("# the fabric\nib_umad\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "modprobe").symlink_to(shim)
    loader = (DEBS / "glm-sim-hardware/usr/lib/glm-sim/modules-load").read_text().replace("/usr/local/sbin/modprobe", str(shim))
    (tmp_path / "modules-load").write_text(loader)
    assert run(["sh", tmp_path / "modules-load"], env=env).returncode == 0
    assert (sim.root / "run/glm-sim/modules/ib_umad").exists()
    unit = (DEBS / "glm-sim-hardware/lib/systemd/system/simulated-modules-load.service").read_text()
    assert "Before=nvidia-fabricmanager.service" in unit and "ExecStart=/usr/lib/glm-sim/modules-load" in unit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_exporter_uses_the_host_engine_it_is_told_to_and_otherwise_embeds_one(sim, tmp_path):
    """dcgm-exporter runs an embedded host engine unless -r / DCGM_REMOTE_HOSTENGINE_INFO names one, which must
    answer at start (nv-hostengine's port, 5555 by default)."""
    engine_port, http_port = free_port(), free_port()
    counters = DEBS / "datacenter-gpu-manager-exporter/etc/dcgm-exporter/default-counters.csv"
    exporter = DEBS / "datacenter-gpu-manager-exporter/usr/bin/dcgm-exporter"
    env = {**os.environ, "GLM_SIM_ROOT": str(sim.root), "PYTHONPATH": str(HW_LIB),
           "DCGM_REMOTE_HOSTENGINE_INFO": f"127.0.0.1:{engine_port}"}
    r = run([exporter, "-f", counters, "-a", f"127.0.0.1:{http_port}"], env=env)
    assert r.returncode == 1
    assert f"dcgm-exporter: cannot connect to the DCGM host engine at 127.0.0.1:{engine_port}" in r.stderr
    engine = subprocess.Popen([DEBS / "datacenter-gpu-manager-4-core/usr/bin/nv-hostengine", "-n", "-p", str(engine_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [engine]
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", engine_port)) == 0:
                    break
            time.sleep(0.05)
        for extra, said in (({}, f"remote 127.0.0.1:{engine_port}"), ({"DCGM_REMOTE_HOSTENGINE_INFO": ""}, None)):
            e = {**env, **extra}
            if said is None:
                del e["DCGM_REMOTE_HOSTENGINE_INFO"]
            p = subprocess.Popen([exporter, "-f", counters, "-a", f"127.0.0.1:{http_port}"], env=e,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(p)
            line = p.stderr.readline()
            assert line.strip() == f"dcgm-exporter: DCGM host engine: {said or 'embedded'}", line
            p.kill()
            p.wait(timeout=10)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
