"""The simulated hardware every stand-in tool reports on.

State comes from /etc/glm-sim/hardware.conf, then /etc/glm-sim/hardware.conf.d/*.conf in name
order (later files win), as shell-style KEY=VALUE lines. GLM_SIM_ROOT, when set, prefixes
/etc/glm-sim, /run/glm-sim, /usr/share/glm-sim and /var/run/nvidia-persistenced so tests can run the
tools against a temp dir.
Identifiers (UUIDs, GUIDs, MACs, serials) derive from the host name, so each simulated host differs
but stays the same across calls.
"""

from __future__ import annotations

# Every stand-in tool imports this module, and a deploy runs them thousands of times: only what each needs is
# imported (hashlib and subprocess where used; no dataclasses, whose inspect import costs more than the rest).
import os
import re
import shlex
import signal
from collections import namedtuple
from pathlib import Path

# Authoritative defaults; the shipped hardware.conf repeats them so operators can see and edit them.
DEFAULTS = {
    "GPU_COUNT": "8",
    "GPU_NAME": "NVIDIA B300 SXM6 AC",
    "GPU_MEMORY_MIB": "275040",
    "FABRIC_STATE": "",
    "FABRIC_STATUS": "",
    "NVLINK_DOWN": "",
    "REMAPPED_PENDING": "",
    "DCGM_FAIL": "",
    "XID_ERRORS": "",
    "NVLINK_CRC_ERRORS": "",
    "RDMA_DEVICES": " ".join(f"mlx5_{i}" for i in range(9)),
    "RDMA_MGMT_DEVICES": "mlx5_8",
    "RDMA_DOWN": "",
    "RDMA_MTU": "4096",
    "RDMA_LINK_LAYER": "Ethernet",
    "RDMA_BW_GBPS": "785.42",
    "RDMA_HOST_OCTET": "",
    "NIC_DISTANCE": "",
    "PCIE_ACS_ON": "",
}

CONF = "/etc/glm-sim/hardware.conf"
CONF_DIR = "/etc/glm-sim/hardware.conf.d"
INSTALLED_DRIVER = "/usr/share/glm-sim/driver-version"
LOADED_DRIVER = "/run/glm-sim/loaded-driver-version"
FABRICMANAGER_VERSION = "/usr/share/glm-sim/fabricmanager-version"
FABRICMANAGER_ACTIVE = "/run/glm-sim/fabricmanager-active"  # stands in for systemd under GLM_SIM_ROOT
# Persistence mode: the persistence daemon's (the stand-in nvidia-persistenced writes it as its options say; its
# unit removes the folder when it stops), else the driver's own (nvidia-smi -pm without the daemon).
PERSISTENCE_DAEMON = "/var/run/nvidia-persistenced/persistence-mode"
PERSISTENCE_DRIVER = "/run/glm-sim/persistence-mode"
# The switch ports setpci turned ACS off on, one per line: under /run, so gone at the next boot, as the
# ACS Control register is reset then.
ACS_OFF = "/run/glm-sim/acs-off"

CUDA_VERSION = "13.0"  # what an R580 driver reports
COMPUTE_CAP = "10.3"
NVLINKS_PER_GPU = 18
NVLINK_SPEED = "53.125 GB/s"
# PCI buses of the eight GPUs on a real HGX B300 (nvidia-smi capture, driver 580.95.05).
GPU_BUSES = (0x1A, 0x3C, 0x62, 0x73, 0x9A, 0xBC, 0xDF, 0xF0)
CPU_AFFINITY = ("0-55,112-167", "56-111,168-223")  # per NUMA node; GPUs 0-3 sit on node 0
MTU_CODES = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MELLANOX_OUI = (0xA0, 0x88, 0xC2)

NO_DRIVER_MESSAGE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


class ConfigError(Exception):
    """hardware.conf says something the simulation cannot represent."""


class NvmlError(Exception):
    """What NVML reports when the driver is not usable; exit_code is nvidia-smi's."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_quietly_on_sigpipe() -> None:
    """Die silently when the reader goes away (`tool | head`), as the real C tools do."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def sim_path(path: str) -> Path:
    return Path(os.environ.get("GLM_SIM_ROOT", "") + path)


def parse_conf(text: str, origin: str) -> dict[str, str]:
    """KEY=VALUE lines as a shell would read them (quotes, trailing comments); unknown keys are
    errors so a mistyped fault key cannot silently leave the hardware healthy."""
    values = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", line)
        if not m:
            raise ConfigError(f"{origin}:{number}: expected KEY=VALUE, got {line!r}")
        key, raw = m.groups()
        if key not in DEFAULTS:
            raise ConfigError(f"{origin}:{number}: unknown key {key}")
        try:
            values[key] = " ".join(shlex.split(raw, comments=True))
        except ValueError as e:
            raise ConfigError(f"{origin}:{number}: {e}") from None
    return values


def load_conf() -> dict[str, str]:
    conf = dict(DEFAULTS)
    files = [sim_path(CONF)] + sorted(sim_path(CONF_DIR).glob("*.conf"))
    for path in files:
        if path.is_file():
            conf.update(parse_conf(path.read_text(), str(path)))
    return conf


def read_version(path: str) -> str | None:
    p = sim_path(path)
    return p.read_text().strip() if p.is_file() else None


def loaded_driver() -> str:
    """The version of the (simulated) loaded kernel module, checked the way NVML checks it
    against the installed user-space library."""
    loaded = read_version(LOADED_DRIVER)
    installed = read_version(INSTALLED_DRIVER)
    if loaded is None or installed is None:
        raise NvmlError(NO_DRIVER_MESSAGE, 9)
    if loaded != installed:
        # NVML prints only major.minor of its own version here.
        library = ".".join(installed.split(".")[:2])
        raise NvmlError(
            f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {library}", 18
        )
    return loaded


def persistence_mode() -> str:
    """"Enabled" or "Disabled", as nvidia-smi reports it."""
    for path in (PERSISTENCE_DAEMON, PERSISTENCE_DRIVER):
        if read_version(path) == "Enabled":
            return "Enabled"
    return "Disabled"


def set_persistence_mode(on: bool) -> None:
    """nvidia-smi -pm: through the daemon when it runs, else in the driver."""
    daemon = sim_path(PERSISTENCE_DAEMON)
    target = daemon if daemon.parent.is_dir() else sim_path(PERSISTENCE_DRIVER)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(("Enabled" if on else "Disabled") + "\n")


def fabricmanager_active() -> bool:
    if os.environ.get("GLM_SIM_ROOT"):
        return sim_path(FABRICMANAGER_ACTIVE).exists()
    try:
        import subprocess

        probe = ["systemctl", "is-active", "--quiet", "nvidia-fabricmanager"]
        return subprocess.run(probe, stderr=subprocess.DEVNULL).returncode == 0
    except FileNotFoundError:
        return False


def fabric_state(conf: dict[str, str], driver: str) -> tuple[str, str]:
    """(State, Status) of the NVLink fabric: it completes only once a fabric manager at exactly
    the driver's version is running. NVML sets Status only once State is Completed (nvmlGpuFabricInfo:
    "must be checked only if state returns complete"): Success, or the NVML error of a failed
    registration (FABRIC_STATUS); before that nvidia-smi prints N/A."""
    state = conf["FABRIC_STATE"]
    if not state:
        fm_matches = read_version(FABRICMANAGER_VERSION) == driver
        state = "Completed" if fm_matches and fabricmanager_active() else "In Progress"
    if state != "Completed":
        return state, "N/A"
    return state, conf["FABRIC_STATUS"] or "Success"


def digest(*parts: object) -> str:
    """A hash of parts salted with the host name: stable across calls, different on each host."""
    from hashlib import sha256

    # os.uname's node name is what gethostname(2) returns.
    return sha256("/".join(str(p) for p in (os.uname().nodename, *parts)).encode()).hexdigest()


def _ints(conf: dict[str, str], key: str) -> set[int]:
    try:
        return {int(word) for word in conf[key].split()}
    except ValueError:
        raise ConfigError(f"{key} must list integers, got {conf[key]!r}") from None


class Gpu(namedtuple("Gpu", "index name memory_mib inactive_links remap_pending")):
    """index: int, name: str, memory_mib: int, inactive_links: frozenset[int], remap_pending: bool."""

    __slots__ = ()

    @property
    def bus(self) -> int:
        return GPU_BUSES[self.index]

    @property
    def bus_id(self) -> str:
        return f"00000000:{self.bus:02X}:00.0"

    @property
    def numa(self) -> int:
        return self.index // 4

    @property
    def cpu_affinity(self) -> str:
        return CPU_AFFINITY[self.numa]

    @property
    def active_links(self) -> int:
        return NVLINKS_PER_GPU - len(self.inactive_links)

    @property
    def uuid(self) -> str:
        h = digest("gpu", self.index)
        return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    @property
    def serial(self) -> str:
        return "16" + str(int(digest("serial", self.index)[:12], 16) % 10**11).zfill(11)

    @property
    def pdi(self) -> str:
        return "0x" + digest("pdi", self.index)[:16]


def gpus(conf: dict[str, str]) -> list[Gpu]:
    try:
        count = int(conf["GPU_COUNT"])
        memory = int(conf["GPU_MEMORY_MIB"])
    except ValueError:
        raise ConfigError("GPU_COUNT and GPU_MEMORY_MIB must be integers") from None
    if not 0 <= count <= len(GPU_BUSES):
        raise ConfigError(f"GPU_COUNT must be 0..{len(GPU_BUSES)}, got {count}")
    down: dict[int, set[int]] = {}
    for pair in conf["NVLINK_DOWN"].split():
        m = re.fullmatch(r"(\d+):(\d+)", pair)
        if not m or int(m[2]) >= NVLINKS_PER_GPU:
            raise ConfigError(f"NVLINK_DOWN entries are gpu:link with link < {NVLINKS_PER_GPU}, got {pair!r}")
        down.setdefault(int(m[1]), set()).add(int(m[2]))
    pending = _ints(conf, "REMAPPED_PENDING")
    return [
        Gpu(i, conf["GPU_NAME"], memory, frozenset(down.get(i, ())), i in pending) for i in range(count)
    ]


def dcgm_failures(conf: dict[str, str]) -> dict[int, set[str] | None]:
    """GPU index -> names of the diag tests it fails, or None for every test it runs."""
    failures: dict[int, set[str] | None] = {}
    for entry in conf["DCGM_FAIL"].split():
        m = re.fullmatch(r"(\d+)(?::([a-z_]+))?", entry)
        if not m:
            raise ConfigError(f"DCGM_FAIL entries are gpu or gpu:test, got {entry!r}")
        gpu, test = int(m[1]), m[2]
        if test is None:
            failures[gpu] = None
        elif failures.get(gpu, set()) is not None:
            failures.setdefault(gpu, set()).add(test)
    return failures


def gpu_counts(conf: dict[str, str], key: str) -> dict[int, int]:
    """``gpu:value`` pairs of ``key`` (XID_ERRORS, NVLINK_CRC_ERRORS) as GPU index -> value."""
    out: dict[int, int] = {}
    for entry in conf[key].split():
        m = re.fullmatch(r"(\d+):(\d+)", entry)
        if not m:
            raise ConfigError(f"{key} entries are gpu:number, got {entry!r}")
        out[int(m[1])] = int(m[2])
    return out


class RdmaDevice(namedtuple("RdmaDevice", "name compute_index link_layer up active_mtu host_octet")):
    """name: str, compute_index: int | None (the rail number of a compute NIC; None for NVSwitch management),
    link_layer: str, up: bool, active_mtu: int, host_octet: int."""

    __slots__ = ()

    @property
    def ethernet(self) -> bool:
        return self.link_layer == "Ethernet"

    @property
    def numa(self) -> int:
        return 0 if self.compute_index is None else self.compute_index // 4

    @property
    def vendor_part_id(self) -> int:
        return 4129 if self.compute_index is None else 4131  # ConnectX-7 / ConnectX-8

    @property
    def fw_ver(self) -> str:
        return "28.45.1200" if self.compute_index is None else "40.46.1006"

    @property
    def board_id(self) -> str:
        return "MT_0000000838" if self.compute_index is None else "MT_0000001093"

    @property
    def rate(self) -> int:
        return 400 if self.compute_index is None else 800

    @property
    def mac(self) -> tuple[int, ...]:
        tail = bytes.fromhex(digest("mac", self.name)[:6])
        return (*MELLANOX_OUI, *tail)

    @property
    def node_guid(self) -> int:
        # ConnectX: OUI, 0x0300, then the low half of the port's MAC.
        m = self.mac
        return int.from_bytes(bytes((m[0], m[1], m[2], 0x03, 0x00, m[3], m[4], m[5])), "big")

    @property
    def port_guid(self) -> int:
        if not self.ethernet:
            return self.node_guid + 1
        m = self.mac  # RoCE: the MAC as a modified EUI-64
        return int.from_bytes(bytes((m[0] ^ 0x02, m[1], m[2], 0xFF, 0xFE, m[3], m[4], m[5])), "big")

    @property
    def pci_bus(self) -> int:
        # Each compute NIC sits two buses below its GPU, behind the same PCIe switch.
        return 0x05 if self.compute_index is None else GPU_BUSES[self.compute_index] - 2

    @property
    def lid(self) -> int:
        if self.ethernet:
            return 0
        return self.host_octet * 16 + (15 if self.compute_index is None else self.compute_index)

    @property
    def sm_lid(self) -> int:
        return 0 if self.ethernet else 1

    @property
    def netdev(self) -> str:
        if self.ethernet:
            return f"ens{self.compute_index + 1}f0np0"
        return f"ibp{self.pci_bus}s0"  # IPoIB, named by PCI bus like the kernel does

    @property
    def ipv4(self) -> str | None:
        return f"10.{100 + self.compute_index}.0.{self.host_octet}" if self.ethernet else None


# nvidia-smi topo -m's PCIe levels, nearest first.
TOPO_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
# On HGX B300 each GPU and its ConnectX-8 sit behind the ConnectX-8's own PCIe switch: PXB (nvidia-smi
# topo -m of 8x B300 SXM6 AC, sgl-project/sglang#26039; tests/fixtures/nvidia-smi-topo).
OWN_NIC_DISTANCE = "PXB"


def nic_distances(conf: dict[str, str]) -> dict[int, str]:
    """NIC_DISTANCE: {GPU index: the level between it and its own compute NIC} where a fault moves it."""
    out: dict[int, str] = {}
    for pair in conf["NIC_DISTANCE"].split():
        m = re.fullmatch(r"(\d+):([A-Z]+)", pair)
        if not m or int(m[1]) >= len(GPU_BUSES) or m[2] not in TOPO_LEVELS:
            raise ConfigError(f"NIC_DISTANCE entries are gpu:level with level one of {', '.join(TOPO_LEVELS)}, "
                              f"got {pair!r}")
        out[int(m[1])] = m[2]
    return out


class PciDevice(namedtuple("PciDevice", "bdf description bus_range acs_on", defaults=(None, None))):
    """One device lspci lists (bdf: str, description: str): a bridge has its bus range (bus_range: tuple[int, int]
    | None); a switch's downstream port its ACS state (acs_on: bool | None; None: no ACS capability)."""

    __slots__ = ()


# The ConnectX-8's PCIe switch that joins each GPU and its NIC (PXB in nvidia-smi topo -m): its ports'
# PCI ids were not found in any capture, so the description says it is simulated. The GPU's id is the
# one this stand-in's nvidia-smi reports (0x3182, 10de); the NICs' are their vendor_part_id (ConnectX-8
# 4131 = 0x1023, ConnectX-7 4129 = 0x1021), the way Mellanox numbers them. lspci prints "Device XXXX"
# for an id its pci.ids does not name.
SWITCH_PORT = "PCI bridge: Mellanox Technologies ConnectX-8 PCIe switch port [simulated] (prog-if 00 [Normal decode])"


def pci_devices(conf: dict[str, str]) -> list[PciDevice]:
    """Below each rail (GPU i and compute NIC i, on GPU_BUSES[i] = B): the switch's upstream port at
    B-4:00.0 (buses B-3..B), its downstream ports B-3:00.0 to the NIC (bus B-2) and B-3:01.0 to the GPU
    (bus B); ACS on the downstream ports of the rails PCIE_ACS_ON lists, until setpci turns it off."""
    on = _ints(conf, "PCIE_ACS_ON")
    if not on <= set(range(len(GPU_BUSES))):
        raise ConfigError(f"PCIE_ACS_ON lists GPU indices 0..{len(GPU_BUSES) - 1}, got {conf['PCIE_ACS_ON']!r}")
    off_path = sim_path(ACS_OFF)
    off = set(off_path.read_text().split()) if off_path.is_file() else set()
    present = {g.index: g for g in gpus(conf)}
    out: list[PciDevice] = []
    for dev in rdma_devices(conf):
        kind = "Ethernet" if dev.ethernet else "Infiniband"
        out.append(PciDevice(f"0000:{dev.pci_bus:02x}:00.0",
                             f"{kind} controller: Mellanox Technologies Device {dev.vendor_part_id:04x}"))
    for rail, bus in enumerate(GPU_BUSES):
        nic, gpu = f"0000:{bus - 3:02x}:00.0", f"0000:{bus - 3:02x}:01.0"
        out += [PciDevice(f"0000:{bus - 4:02x}:00.0", SWITCH_PORT, (bus - 3, bus)),
                PciDevice(nic, SWITCH_PORT, (bus - 2, bus - 2), rail in on and nic not in off),
                PciDevice(gpu, SWITCH_PORT, (bus, bus), rail in on and gpu not in off)]
        if rail in present:
            out.append(PciDevice(f"0000:{bus:02x}:00.0", "3D controller: NVIDIA Corporation Device 3182 (rev a1)"))
    return sorted(out, key=lambda d: d.bdf)


def rdma_devices(conf: dict[str, str]) -> list[RdmaDevice]:
    mtu_text = conf["RDMA_MTU"]
    if not mtu_text.isdigit() or int(mtu_text) not in MTU_CODES:
        raise ConfigError(f"RDMA_MTU must be one of {sorted(MTU_CODES)}, got {mtu_text!r}")
    if conf["RDMA_LINK_LAYER"] not in ("Ethernet", "InfiniBand"):
        raise ConfigError(f"RDMA_LINK_LAYER must be Ethernet or InfiniBand, got {conf['RDMA_LINK_LAYER']!r}")
    octet = conf["RDMA_HOST_OCTET"] or str(2 + int(digest("octet")[:8], 16) % 250)
    if not octet.isdigit() or not 1 <= int(octet) <= 254:
        raise ConfigError(f"RDMA_HOST_OCTET must be 1..254, got {octet!r}")
    mgmt = set(conf["RDMA_MGMT_DEVICES"].split())
    down = set(conf["RDMA_DOWN"].split())
    devices, rail = [], 0
    for name in conf["RDMA_DEVICES"].split():
        if name in mgmt:
            devices.append(RdmaDevice(name, None, "InfiniBand", name not in down, 4096, int(octet)))
        elif rail < len(GPU_BUSES):
            devices.append(
                RdmaDevice(name, rail, conf["RDMA_LINK_LAYER"], name not in down, int(mtu_text), int(octet))
            )
            rail += 1
        else:
            raise ConfigError(f"RDMA_DEVICES lists more than {len(GPU_BUSES)} compute NICs (one per GPU)")
    return devices


def guid_colons(guid: int) -> str:
    """GUID as ibv_devinfo prints it: four groups of four hex digits."""
    h = f"{guid:016x}"
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


def gid(device: RdmaDevice, ipv4: bool) -> str:
    """A GID as sysfs and show_gids print it: eight groups of four hex digits."""
    if ipv4:
        a, b, c, d = (int(x) for x in device.ipv4.split("."))
        raw = bytes(10) + b"\xff\xff" + bytes((a, b, c, d))
    else:
        raw = bytes.fromhex("fe80000000000000") + device.port_guid.to_bytes(8, "big")
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))
