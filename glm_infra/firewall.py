"""The network policy of one host, from the plan (``ports.listeners``): an nftables table of glm-infra's
own, ``inet glm_infra``, that lets the stack's hosts reach every port glm-infra opens there, the
router's public port also ``router.allowedCidrs``, Prometheus and Alertmanager also
``monitoring.allowedCidrs``, and refuses everyone else (a TCP reset: the client sees "connection
refused"). Nothing else is touched: SSH, other services and other tables are not this table's.

A systemd unit loads it before the network comes up, on every boot; a new plan (a host added, a port
moved) rewrites it; ``destroy`` deletes the table. Pure: the per-host plan takes ``step``.
"""

from __future__ import annotations

import ipaddress

from . import paths, ports, render
from .config import StackConfig
from .steps import RenderedFile, Step, digest
from .topology import HostPlan, Plan

TABLE = "inet glm_infra"
UNIT = "glm-infra-firewall.service"
RULESET = f"{paths.ETC}/firewall.nft"


def _split(addresses: list[str]) -> tuple[list[str], list[str], list[str]]:
    """IPv4 and IPv6 addresses or networks, and DNS names (nft resolves those when it loads the table)."""
    v4, v6, names = [], [], []
    for a in addresses:
        try:
            net = ipaddress.ip_network(a, strict=False)
        except ValueError:
            names.append(a)
            continue
        (v4 if net.version == 4 else v6).append(str(net))
    return sorted(set(v4)), sorted(set(v6)), sorted(set(names))


def audiences(stack: StackConfig) -> dict[str, list[str]]:
    """Who may reach each kind of port: the stack's hosts, and for the public ports the stack's CIDRs."""
    peers = [h.address for h in stack.hosts]
    return {
        ports.PEERS: peers,
        ports.ROUTER: peers + (list(stack.router.allowed_cidrs) if stack.router is not None else []),
        ports.OPERATORS: peers + list(stack.monitoring.allowed_cidrs),
    }


def ruleset(stack: StackConfig, plan: Plan, host: str) -> str:
    """The table for ``host``: per audience, a set of who may connect and the TCP ports they may reach."""
    mine = [li for li in ports.listeners(stack, plan.serve) if li.host == host]
    body: list[str] = []
    rules: list[str] = []
    for audience, who in audiences(stack).items():
        port_list = sorted({li.port for li in mine if li.audience == audience})
        if not port_list:
            continue
        v4, v6, names = _split(who)
        for family, members in (("v4", v4 + [n for n in names]), ("v6", v6)):
            kind = "ipv4_addr" if family == "v4" else "ipv6_addr"
            elements = f" elements = {{ {', '.join(members)} }}" if members else ""
            body.append(f"\tset {audience}_{family} {{ type {kind}; flags interval;{elements} }}")
        what = ", ".join(sorted({li.owner for li in mine if li.audience == audience}))
        numbers = ", ".join(str(p) for p in port_list)
        rules += [f"\t\t# {audience}: {what}",
                  f"\t\ttcp dport {{ {numbers} }} ip saddr @{audience}_v4 accept",
                  f"\t\ttcp dport {{ {numbers} }} ip6 saddr @{audience}_v6 accept",
                  f"\t\ttcp dport {{ {numbers} }} reject with tcp reset"]
    inner = "\n".join([*body, "\tchain input {", "\t\ttype filter hook input priority filter - 5; policy accept;",
                       '\t\tiifname "lo" accept', *rules, "\t}"])
    stamp = digest(inner)
    return (f"# Managed by glm-infra: who may reach glm-infra's ports on {host} (the stack's hosts, and the CIDRs\n"
            "# the stack lists for its public ports). Only this table is glm-infra's; SSH and everything else\n"
            "# are left as they are. Loaded by glm-infra-firewall.service at boot.\n"
            f"table {TABLE}\ndelete table {TABLE}\ntable {TABLE} {{\n\tcomment \"glm-infra {stamp}\"\n{inner}\n}}\n")


def unit() -> str:
    return (
        "# Managed by glm-infra: its nftables table, loaded before the network comes up.\n"
        "[Unit]\nDescription=glm-infra firewall: its ports for the stack's hosts only (nftables table inet glm_infra)\n"
        "DefaultDependencies=no\nWants=network-pre.target\nBefore=network-pre.target shutdown.target\n"
        "Conflicts=shutdown.target\n\n[Service]\nType=oneshot\nRemainAfterExit=yes\n"
        f"ExecStart=/usr/sbin/nft -f {RULESET}\nExecReload=/usr/sbin/nft -f {RULESET}\n"
        f"ExecStop=/usr/sbin/nft delete table {TABLE}\n\n[Install]\nWantedBy=sysinit.target\n"
    )


def step(stack: StackConfig, plan: Plan, h: HostPlan) -> Step | None:
    if not stack.firewall.enabled:
        return None
    rules = ruleset(stack, plan, h.name)
    stamp = rules.split('comment "glm-infra ', 1)[1].split('"', 1)[0]
    # Loaded as written: a table flushed or edited by hand no longer carries glm-infra's stamp.
    live = (f'grep -qF \'comment "glm-infra {stamp}"\' <<<"$(nft list table {TABLE} 2>/dev/null)" || '
            f'{{ echo "the table {TABLE} is not the one glm-infra wrote (flushed, edited or deleted by hand?)"; false; }}')
    return render.package_service_step(
        "firewall", f"nftables table {TABLE}: glm-infra's ports for the stack's hosts", h.name, ["nftables"], [UNIT],
        [], [RenderedFile(RULESET, rules), RenderedFile(paths.unit(UNIT), unit())],
        config_check=f"nft -c -f {RULESET}", live_check=live)
