"""Where glm-infra puts things on a host, in one place. Templates get these as ``paths``."""

from __future__ import annotations

LIBEXEC = "/usr/local/libexec/glm-infra"  # host scripts and the host programs
ETC = "/etc/glm-infra"
SECRETS_DIR = f"{ETC}/secrets"  # root-owned 0600 files, the only place secrets land
UNIT_DIR = "/etc/systemd/system"
OPT = "/opt/glm-infra"  # uv, the hf CLI environment (the venv's default parent too)
STATE = "/var/lib/glm-infra"  # what survives a reboot
RUN = "/run/glm-infra"  # what must not (reboot-required markers)

HOSTCHECK = f"{LIBEXEC}/hostcheck.py"
WEIGHTS = f"{LIBEXEC}/weights.py"
UCX_ENV = f"{ETC}/ucx.env"
NIC_AFFINITY_ENV = f"{ETC}/nic-affinity.env"  # written on the host from its own topology (nixl.nicPerRank)
VLLM_SECRETS = f"{SECRETS_DIR}/vllm.env"
ROUTER_SECRETS = f"{SECRETS_DIR}/router.env"
HF_SECRETS = f"{SECRETS_DIR}/hf.env"
RELAY_KEY = f"{SECRETS_DIR}/relay.env"  # the stack's relay key (GLM_RELAY_KEY=): what crosses hosts is signed with it
FRONT_CONF = "/etc/nginx/conf.d/glm-infra-router.conf"
FRONT_KEYS = f"{SECRETS_DIR}/router-front-keys.conf"
# TLS of the router's public port: what nginx serves, and the CA glm-infra signs it with when the stack
# gives no certificate (its key never leaves the host).
TLS_DIR = f"{ETC}/tls"
FRONT_CERT = f"{TLS_DIR}/front.crt"
FRONT_KEY = f"{TLS_DIR}/front.key"
FRONT_CA = f"{TLS_DIR}/ca.crt"
FRONT_CA_KEY = f"{TLS_DIR}/ca.key"
FRONT_TLS_GIVEN = f"{SECRETS_DIR}/router-tls.pem"  # router.tlsCertificate + tlsKey, when the stack sets them
FRONT_CA_GIVEN = f"{SECRETS_DIR}/router-ca.pem"  # router.host's generated CA, on the other router hosts
# Canaries (the router's host): the program, what it asks, the answers it recorded, and the flags of the
# instances whose canary fails (the gates answer /health 503 for them; gone at reboot, the next run
# writes them again).
CANARY = f"{LIBEXEC}/canary.py"
CANARY_TARGETS = f"{ETC}/canary-targets.json"
CANARY_STATE = f"{STATE}/canary"
CANARY_FLAGS = "/run/glm-canary"  # the canary unit's RuntimeDirectory (preserved between its runs)
GATES_CONF = "/etc/nginx/conf.d/glm-infra-gates.conf"
# While the router restarts, its front passes every request to another router's front: a file here makes it so
# (tmpfs: a reboot never leaves a front drained).
FRONT_DRAIN_DIR = f"{RUN}/router-drain"
FRONT_DRAIN = f"{FRONT_DRAIN_DIR}/front.conf"
KEEPALIVED_CONF = "/etc/keepalived/keepalived.conf"  # the package's own path (its unit's ConditionFileNotEmpty)
VRRP_STATE = f"{RUN}/router-vrrp.state"  # MASTER, BACKUP or FAULT: what keepalived said last (its notify script)
NONLOCAL_BIND_SYSCTL = "/etc/sysctl.d/60-glm-infra-router.conf"  # the front listens on the virtual address too
HF_ENV = f"{OPT}/hf"
BOOT_BEFORE_REBOOT = f"{STATE}/boot-before-reboot"
ROLLOUT_DIR = f"{STATE}/rollout"  # per unit, the triggers digest it last (re)started with
PLACEMENT_DIR = f"{STATE}/placement"  # per vLLM unit, where the plan put it: written before issue 38, now only removed
REBOOT_UNIT = "glm-infra-reboot"  # the transient timer and service the reboot step schedules
# A rolling host change: the units the drain stopped (kept across the reboot, for the return), the roll
# last completed, and a record of each phase with its time (one line each).
DRAINED = f"{STATE}/roll-drained"
ROLLED = f"{STATE}/roll-done"
ROLL_LOG = f"{STATE}/roll.log"
# On the machine running pulumi: the turns of each pool (GLM_INFRA_LEASES overrides it).
LEASES = "/tmp/glm-infra-leases"

# The monitoring, where the Debian and Ubuntu packages look (prometheus, prometheus-alertmanager,
# prometheus-node-exporter) and NVIDIA's datacenter-gpu-manager-exporter.
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_RULES = "/etc/prometheus/glm-infra-rules.yml"
ALERTMANAGER_CONFIG = "/etc/prometheus/alertmanager.yml"
PROMETHEUS_DEFAULTS = "/etc/default/prometheus"
ALERTMANAGER_DEFAULTS = "/etc/default/prometheus-alertmanager"
NODE_EXPORTER_DEFAULTS = "/etc/default/prometheus-node-exporter"
NODE_EXPORTER_TEXTFILES = "/var/lib/prometheus/node-exporter"  # the textfile collector's folder (Debian's)
CANARY_METRICS = f"{NODE_EXPORTER_TEXTFILES}/glm-canary.prom"
# Each glm-infra unit's memory from its cgroup (every host with an instance or the router), every few seconds.
UNIT_MEMORY = f"{LIBEXEC}/unit_memory.py"
UNIT_MEMORY_UNITS = f"{ETC}/unit-memory.json"
UNIT_MEMORY_METRICS = f"{NODE_EXPORTER_TEXTFILES}/glm-unit-memory.prom"
DCGM_EXPORTER_COUNTERS = "/etc/dcgm-exporter/glm-infra-counters.csv"
WEBHOOK_SECRET = f"{SECRETS_DIR}/alertmanager-webhook-url"
DEAD_MANS_SWITCH_SECRET = f"{SECRETS_DIR}/alertmanager-dead-mans-switch-url"


def dropin(unit: str) -> str:
    """glm-infra's drop-in for a unit another package owns."""
    return f"{UNIT_DIR}/{unit}.d/glm-infra.conf"


def credential(unit: str, name: str) -> str:
    """Where systemd shows a unit the credential ``name`` it loads (LoadCredential=)."""
    return f"/run/credentials/{unit}/{name}"


# vLLM's warm-start caches, relative to the services' home (HOME, home() below): what the warm-cache relay
# copies from a pool's first host to its others (docs/research/vllm-0.33-compile-cache.md §1.5). Not the
# host-specific ones beside them: gpu_p2p_access_cache_*.json, startup_plan/. Not torch.compile's cache
# (torch_compile_cache: pickled graph modules and generated Python, loaded as code; GLM-5.2 is not
# torch.compiled in vLLM 0.33.0 anyway, §"Short answer").
WARM_CACHES = (".cache/vllm/flashinfer_autotune_cache", ".cache/vllm/deep_gemm", ".cache/flashinfer", ".triton/cache")
# The kinds of file relayed from those caches (fnmatch of the name): tuning results and GPU code or its IR —
# FlashInfer's autotune_configs*.json, DeepGEMM's and FlashInfer's kernel.cubin, Triton's <kernel>.json,
# .ttir, .ttgir, .llir, .ptx, .cubin. Never what runs on the host (Triton's launcher and FlashInfer's JIT
# .so, .py, pickles): the services' user writes these folders, and another host's services would load it.
WARM_CACHE_KINDS = ("*.json", "*.cubin", "*.ptx", "*.ttir", "*.ttgir", "*.llir")


def home(state_dir: str) -> str:
    """HOME of the services (vLLM's caches live under it): runtime.stateDir/home."""
    return f"{state_dir}/home"


def warm_cache(state_dir: str, role: str) -> str:
    """Where a host keeps the pool's relayed warm-start caches (their revisions beside, as the weights')."""
    return f"{state_dir}/warm-cache/{role}"


def warm_cache_relay_unit(role: str) -> str:
    """The transient unit the pool's first host serves its warm-start caches from (systemd-run)."""
    return f"glm-warm-cache-{role}"


def uv_dir(version: str) -> str:
    return f"{OPT}/uv-{version}"


def script(name: str) -> str:
    """Where the host script ``name`` (drivers, rdma, glm-vllm-prefill-0, …) is installed."""
    return f"{LIBEXEC}/{name}.sh"


def unit(name: str) -> str:
    return f"{UNIT_DIR}/{name}"


def url_host(address: str) -> str:
    """An address as the host part of a URL (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address
