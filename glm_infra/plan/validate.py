"""Cross-field rules of a stack that a single pydantic model cannot see.

Each rule returns ``Problem`` entries naming the key path, so the CLI and ``pulumi up`` print the
same messages. Rules run only on a stack whose individual keys already parsed.
"""

from __future__ import annotations

import difflib
import ipaddress
import posixpath
import re
from collections import defaultdict

from glm_infra.spec import pins
from glm_infra.spec.config import SECRET_VALUE_RULES, SECRETS, StackConfig, snake

from . import model_checks, ports
from .problem import Problem, key_path


def secret_value_problem(name: str, value: str) -> Problem | None:
    """A secret whose value breaks the file it lands in (config.SECRET_VALUE_RULES); the message
    names the key and the rule, never the value."""
    rule = SECRET_VALUE_RULES.get(name)
    if rule is None or re.fullmatch(rule[0], value):
        return None
    top, sub = SECRETS[name]
    return Problem(key_path(top, f".{sub}"), f"the secret's value is not {rule[1]}")


def check(stack: StackConfig, serve: bool = True, capacity: bool = True) -> list[Problem]:
    """Every cross-field problem of a stack. ``serve=False``: hosts provisioned without pools (the
    pools, the router and their ports are not judged). ``capacity=False``: not the KV room (the
    facts it needs may not exist yet)."""
    problems: list[Problem] = []
    problems += _hosts_unique(stack)
    if serve:
        problems += _pool_shape(stack)
    problems += _host_references(stack, serve)
    if problems:
        return problems  # budgets and ports are meaningless with unknown hosts
    if serve:
        problems += _gpu_budget(stack)
        problems += _kv_nics(stack)
        problems += _closed_sets(stack)
        problems += _set_twice(stack)
        problems += _router_tls(stack)
    problems += model_checks.weight_format_problems(stack)
    problems += _safe_paths(stack)
    problems += _firewall_addresses(stack)
    problems += _firewall_allowlists(stack, serve)
    problems += _port_collisions(stack, serve)
    if serve and capacity and not problems:
        problems += model_checks.capacity_problems(stack)
    return problems


def _hosts_unique(stack: StackConfig) -> list[Problem]:
    out = []
    seen_name: dict[str, int] = {}
    seen_addr: dict[str, int] = {}
    for i, h in enumerate(stack.hosts):
        if h.name in seen_name:
            out.append(Problem(key_path("hosts", f"[{i}].name"), f"duplicate host name {h.name!r} (also hosts[{seen_name[h.name]}])"))
        else:
            seen_name[h.name] = i
        addr = h.address.lower()
        if addr in seen_addr:
            out.append(
                Problem(key_path("hosts", f"[{i}].address"), f"duplicate address {h.address!r} (also hosts[{seen_addr[addr]}])")
            )
        else:
            seen_addr[addr] = i
    return out


def _pool_shape(stack: StackConfig) -> list[Problem]:
    out = []
    has_p, has_d, has_c = stack.prefill is not None, stack.decode is not None, stack.colocated is not None
    if has_c and (has_p or has_d):
        out.append(Problem(key_path("colocated"), "a colocated pool cannot be combined with prefill/decode pools"))
    elif has_p != has_d:  # (with no pool at all, the stack model lays out the recipe's)
        present, missing = ("prefill", "decode") if has_p else ("decode", "prefill")
        out.append(Problem(key_path(missing), f"P/D needs both pools: {present} is set but {missing} is missing"))
    if stack.disaggregated and stack.router is None:
        out.append(Problem(key_path("router"), "P/D needs a router in front of the prefill and decode pools"))
    for role, pool in stack.pools():
        if pool.gpus_per_instance > 16:
            out.append(Problem(key_path(role, ".dp"), f"tp×dp = {pool.gpus_per_instance} GPUs, more than one host has"))
    if stack.prefill is not None and stack.decode is not None:
        # P and D must agree on the MTP method; only the token count may differ.
        if (stack.prefill.speculative_tokens == 0) != (stack.decode.speculative_tokens == 0):
            out.append(
                Problem(key_path("decode", ".speculativeTokens"), "prefill and decode must both use MTP or both not")
            )
    return out


def _host_references(stack: StackConfig, serve: bool = True) -> list[Problem]:
    names = [h.name for h in stack.hosts]
    known = ", ".join(names)
    out = []
    if not serve:
        seed = stack.model.seed_host
        if seed is not None and seed not in names:
            out.append(Problem(key_path("model", ".seedHost"), f"unknown host {seed!r} (hosts are: {known})"))
        return out
    for role, pool in stack.pools():
        for i, h in enumerate(pool.hosts):
            if h not in names:
                out.append(Problem(key_path(role, f".hosts[{i}]"), f"unknown host {h!r} (hosts are: {known})"))
    if stack.router is not None and stack.router.host not in names:
        out.append(Problem(key_path("router", ".host"), f"unknown host {stack.router.host!r} (hosts are: {known})"))
    if stack.router is not None:
        out += _router_standbys(stack, names)
    mon = stack.monitoring.host
    if stack.monitoring.enabled and mon is not None and mon not in names:
        out.append(Problem(key_path("monitoring", ".host"), f"unknown host {mon!r} (hosts are: {known})"))
    seed = stack.model.seed_host
    serving = [h for _, pool in stack.pools() for h in pool.hosts]
    if seed is not None and seed not in serving:
        out.append(Problem(key_path("model", ".seedHost"), f"{seed!r} runs no vLLM instance (serving hosts: {', '.join(dict.fromkeys(serving))})"))
    return out


def _router_standbys(stack: StackConfig, names: list[str]) -> list[Problem]:
    """router.standbyHosts: known hosts, each once and not router.host, behind a virtual IPv4 address
    no host uses, the router hosts' own addresses IPv4 too (VRRP here is IPv4, unicast between them)."""
    r = stack.router
    assert r is not None
    out = []
    for i, h in enumerate(r.standby_hosts):
        if h not in names:
            out.append(Problem(key_path("router", f".standbyHosts[{i}]"), f"unknown host {h!r} (hosts are: {', '.join(names)})"))
        elif h == r.host or h in r.standby_hosts[:i]:
            out.append(Problem(key_path("router", f".standbyHosts[{i}]"),
                               f"{h!r} already runs a router (router.host and standbyHosts name each host once)"))
    if r.standby_hosts and r.virtual_address is None:
        out.append(Problem(key_path("router", ".virtualAddress"),
                           f"router.standbyHosts ({', '.join(r.standby_hosts)}) needs the address clients use, held "
                           "by one router host at a time: set router.virtualAddress (an unused address of the "
                           "hosts' network)"))
    if r.virtual_address is None or out:
        return out
    by_address = {h.address: h.name for h in stack.hosts}
    if str(r.virtual_address) in by_address:
        out.append(Problem(key_path("router", ".virtualAddress"),
                           f"{r.virtual_address} is {by_address[str(r.virtual_address)]}'s own address: the virtual "
                           "address moves between the router hosts and must be used by no host"))
    for h in [r.host, *r.standby_hosts]:
        if h in names and not _is_ipv4(stack.host(h).address):  # (an unknown router.host is named above)
            out.append(Problem(key_path("router", ".virtualAddress"),
                               f"router host {h}'s address is {stack.host(h).address!r}: the routers speak VRRP to "
                               "each other's IPv4 address (unicast); give the router hosts IPv4 addresses"))
    return out


def _is_ipv4(address: str) -> bool:
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return True


def _kv_nics(stack: StackConfig) -> list[Problem]:
    """P/D moves the KV cache over RDMA: every prefill and decode host names its compute NICs."""
    kv_hosts = {h for role in ("prefill", "decode") if (pool := getattr(stack, role)) for h in pool.hosts}
    return [Problem(key_path("hosts", f"[{i}].computeNics"),
                    f"host {h.name} runs prefill/decode instances, which move the KV cache over RDMA: list its "
                    "compute NICs (never the NVSwitch-management ConnectX)")
            for i, h in enumerate(stack.hosts) if h.name in kv_hosts and not h.compute_nics] + (
        [Problem(key_path("nixl", ".nicPerRank"), "needs rdma.stack doca-ofed: ibdev2netdev -v gives each compute "
                                                  "NIC's PCI address (set nixl.nicPerRank: false with the inbox stack)")]
        if stack.nixl.nic_per_rank and stack.rdma.stack != "doca-ofed" and kv_hosts else [])


def _gpu_budget(stack: StackConfig) -> list[Problem]:
    used: dict[str, list[str]] = defaultdict(list)
    count: dict[str, int] = defaultdict(int)
    for role, pool in stack.pools():
        for h in pool.hosts:
            used[h].append(f"{role} {pool.instances_per_host}×{pool.gpus_per_instance}")
            count[h] += pool.instances_per_host * pool.gpus_per_instance
    out = []
    for i, h in enumerate(stack.hosts):
        if count[h.name] > h.gpus:
            out.append(
                Problem(
                    key_path("hosts", f"[{i}].gpus"),
                    f"host {h.name} is over-subscribed: {' + '.join(used[h.name])} = {count[h.name]} GPUs, "
                    f"the host has {h.gpus}",
                )
            )
    return out


def _port_collisions(stack: StackConfig, serve: bool = True) -> list[Problem]:
    owners: dict[tuple[str, int], str] = {}
    clashes: dict[tuple[str, str, str, str], list[int]] = defaultdict(list)
    out: list[Problem] = []
    for listener in ports.listeners(stack, serve):
        host, port, owner, path = listener.host, listener.port, listener.owner, listener.key
        if port > 65535:
            out.append(Problem(path, f"{owner} on {host} would need port {port}, above 65535"))
            continue
        prev = owners.setdefault((host, port), owner)
        if prev != owner:
            clashes[(path, host, prev, owner)].append(port)
    for (path, host, prev, owner), taken in clashes.items():
        span = str(taken[0]) if len(taken) == 1 else f"{taken[0]}-{taken[-1]}"
        word = "port" if len(taken) == 1 else "ports"
        out.append(Problem(path, f"{word} {span} on {host} used twice: {prev} and {owner}"))
    return out


# --- choices of the pinned versions ------------------------------------------------------------------

_MODEL_CHOICES = {"toolCallParser": "tool call parser", "reasoningParser": "reasoning parser",
                  "speculativeMethod": "speculative decoding method", "fingerprintMode": "fingerprint mode",
                  "chatTemplateContentFormat": "chat template content format", "kvCacheDtype": "KV cache dtype"}
_POOL_CHOICES = {"all2allBackend": "all2all backend", "cudagraphMode": "CUDA graph mode"}


def _not_a_choice(value: str, what: str, choices: tuple[str, ...], who: str) -> str:
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    listed = ", ".join(choices) if len(choices) <= 16 else f"{len(choices)} choices, glm_infra/spec/pins.py lists them"
    return f"{value!r} is not a {what} of {who} ({hint}{listed})"


def _closed_sets(stack: StackConfig) -> list[Problem]:
    """Values vLLM and the router take from a closed set, against the sets of the versions the stack runs
    (a version glm_infra/spec/pins.py does not know is not checked: stack warnings say so)."""
    out = []
    release = pins.release(stack.runtime.vllm_version)
    vllm = pins.VLLM_CHOICES.get(release)
    if vllm is not None:
        for key, what in _MODEL_CHOICES.items():
            value = getattr(stack.model, snake(key))
            if value is not None and value not in vllm[key]:
                out.append(Problem(key_path("model", f".{key}"), _not_a_choice(value, what, vllm[key], f"vLLM {release}")))
        for role, pool in stack.pools():
            for key, what in _POOL_CHOICES.items():
                value = getattr(pool, snake(key))
                if value is not None and value not in vllm[key]:
                    out.append(Problem(key_path(role, f".{key}"), _not_a_choice(value, what, vllm[key], f"vLLM {release}")))
    router_release = pins.release(stack.runtime.router_version)
    router = pins.ROUTER_CHOICES.get(router_release)
    if router is not None and stack.router is not None and stack.router.policy not in router["policy"]:
        out.append(Problem(key_path("router", ".policy"), _not_a_choice(stack.router.policy, "routing policy",
                                                                    router["policy"], f"vllm-router {router_release}")))
    return out


# --- one setting, one place ------------------------------------------------------------------------

# vllm serve flags glm-infra writes, with the key that sets each (their short and long spellings).
_FLAG_OWNERS = {
    "--tensor-parallel-size": "{role}.tp", "-tp": "{role}.tp",
    "--data-parallel-size": "{role}.dp", "-dp": "{role}.dp",
    "--enable-expert-parallel": "{role}.ep", "-ep": "{role}.ep",
    "--gpu-memory-utilization": "{role}.gpuMemoryUtilization",
    "--max-num-batched-tokens": "{role}.maxNumBatchedTokens",
    "--compilation-config": "{role}.cudagraphMode", "-O": "{role}.cudagraphMode", "-cc": "{role}.cudagraphMode",
    "--all2all-backend": "{role}.all2allBackend",
    "--speculative-config": "{role}.speculativeTokens and model.speculativeMethod",
    "--shutdown-timeout": "{role}.shutdownTimeout",
    "--kv-transfer-config": "the pool's role in P/D",
    "--host": "the host's address", "--port": "{role}.httpPort",
    "--data-parallel-rpc-port": "{role}.dpRpcPort",
    "--served-model-name": "model.servedModelName",
    "--trust-remote-code": "model.trustRemoteCode",
    "--chat-template-content-format": "model.chatTemplateContentFormat",
    "--tool-call-parser": "model.toolCallParser", "--enable-auto-tool-choice": "model.enableAutoToolChoice",
    "--reasoning-parser": "model.reasoningParser",
    "--enable-prompt-tokens-details": "model.enablePromptTokensDetails",
    "--fingerprint-mode": "model.fingerprintMode",
    "--model": "model.path",
    "--kv-cache-dtype": "model.kvCacheDtype",
    "--max-model-len": "model.maxModelLen",
}
# Environment variables glm-infra sets for every instance (the unit, the UCX and secrets files).
_ENV_OWNERS = {
    "VLLM_USE_V2_MODEL_RUNNER": "{role}.modelRunnerV2",
    "CUDA_VISIBLE_DEVICES": "the plan (GPUs are handed out per instance)",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "the host's address", "VLLM_NIXL_SIDE_CHANNEL_PORT": "{role}.nixlSideChannelPort",
    "HOME": "runtime.stateDir", "HF_HUB_OFFLINE": "glm-infra (the weights are staged before the instances start)",
    "UCX_NET_DEVICES": "hosts[].computeNics and nixl.nicPerRank", "UCX_TLS": "nixl.ucxTls",
    "UCX_IB_GID_INDEX": "rdma.gidIndex", "VLLM_GPU_NIC_PCIE_MAPPING": "nixl.nicPerRank (each host's topology)",
    "VLLM_NIC_SELECTION_VARS": "nixl.nicPerRank", "CUDA_DEVICE_ORDER": "nixl.nicPerRank",
    "VLLM_API_KEY": "router.apiKey",
}


def _set_twice(stack: StackConfig) -> list[Problem]:
    """A setting glm-infra writes, given again through extraArgs or env: refused (which one would win
    depends on vLLM's parser or systemd's order, and the stack would say one thing and run another)."""
    out = []
    for role, pool in stack.pools():
        for i, arg in enumerate(pool.extra_args):
            flag = arg.split("=", 1)[0]
            if flag in _FLAG_OWNERS:
                owner = _FLAG_OWNERS[flag].format(role=role)
                out.append(Problem(key_path(role, f".extraArgs[{i}]"), f"{flag} is set by glm-infra from {owner}; "
                                                                   "set that instead of repeating it here"))
        for name in pool.env:
            if name in _ENV_OWNERS:
                owner = _ENV_OWNERS[name].format(role=role)
                out.append(Problem(key_path(role, f".env.{name}"), f"{name} is set by glm-infra from {owner}; "
                                                               "set that instead of repeating it here"))
    return out


# --- the router's certificate ------------------------------------------------------------------


def _router_tls(stack: StackConfig) -> list[Problem]:
    r = stack.router
    if r is None:
        return []
    if (r.tls_certificate is None) != (r.tls_key is None):
        given, missing = ("tlsCertificate", "tlsKey") if r.tls_key is None else ("tlsKey", "tlsCertificate")
        return [Problem(key_path("router", f".{missing}"), f"router.{given} is set but router.{missing} is not: "
                                                       "give both (secrets), or neither for a generated certificate")]
    if r.tls_certificate is not None and r.tls_names:
        return [Problem(key_path("router", ".tlsNames"), "names the generated certificate; with router.tlsCertificate "
                                                     "the certificate's own names are served (drop tlsNames)")]
    return []


# --- paths destroy may delete ----------------------------------------------------------------------

# Folders that are the system's, not glm-infra's: none of them (nor a folder above one) may be a folder
# glm-infra creates and removes (the venv, the services' state, the checkpoint).
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt",
               "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/lib", "/var/log",
               "/usr/local", "/usr/lib", "/opt/glm-infra")
_UNDER_SYSTEM = ("/bin/", "/boot/", "/dev/", "/etc/", "/lib/", "/lib32/", "/lib64/", "/proc/", "/sbin/", "/sys/",
                 "/usr/", "/run/")


def _safe_paths(stack: StackConfig) -> list[Problem]:
    out = []
    for path, value, what in (("model.path", stack.model.path, "the checkpoint (destroy may delete it; e.g. "
                               "/mnt/model/glm/GLM-5.2-NVFP4)"),
                              ("runtime.venv", stack.runtime.venv, "the venv (destroy deletes it; e.g. /opt/glm-infra/venv)"),
                              ("runtime.stateDir", stack.runtime.state_dir, "the services' state (destroy deletes it; "
                               "e.g. /var/lib/glm-infra)")):
        norm = posixpath.normpath(value)
        if norm in SYSTEM_DIRS or norm.startswith(_UNDER_SYSTEM):
            top, _, sub = path.partition(".")
            out.append(Problem(key_path(top, f".{sub}"), f"{value!r} is a system folder or inside one; {what} needs a "
                                                     "folder of its own"))
    return out


def _firewall_addresses(stack: StackConfig) -> list[Problem]:
    return [Problem(path, message) for path, message in ports.firewall_problems(stack)]




def _firewall_allowlists(stack: StackConfig, serve: bool = True) -> list[Problem]:
    """Who may log in over SSH and who may reach the router's public port: the stack's to say whenever the
    firewall is on (every host of every stack is real, a simulated one included); an open one is a warning."""
    return [Problem(path, message) for path, message in ports.unset_allowlists(stack, serve)]
