"""The network policy of one host, from the plan (``ports.listeners``): an nftables table of glm-infra's
own, ``inet glm_infra``, whose input chain drops what it does not let in. It lets in:

- loopback, replies to connections the host made (established, related), ICMP and ICMPv6 (IPv6
  neighbour discovery), DHCP and DHCPv6 replies (the host's address lease);
- SSH (the host's ``sshPort``) from ``firewall.adminCidrs`` and the stack's hosts (validate refuses a
  stack that leaves ``adminCidrs`` unset: glm-infra cannot know where its operators log in from; open to
  all is ``0.0.0.0/0`` and ``::/0``, said on purpose and warned about);
- every port glm-infra opens there from the stack's hosts, the router's public port also from
  ``router.allowedCidrs``, Prometheus and Alertmanager also from ``monitoring.allowedCidrs``; anyone
  else gets a TCP reset on these ports (the client sees "connection refused").

Everything else (a listener the plan does not know) is dropped, by the chain's last rule rather than
its policy: a table flushed by hand (its rules gone, its chain kept) must not cut the host off, SSH
included; the step's check finds the flush. Other tables are not touched, but a packet this chain
drops is dropped whatever they say. Addresses are IP addresses and networks only:
nft would resolve a DNS name when it loads the table, at boot before the network is up, and the
table would not load (``plan.ports.firewall_problems`` refuses a host named by DNS while the firewall is on).

A systemd unit loads it before the network comes up, on every boot (after the distribution's
nftables.service, whose ``flush ruleset`` would otherwise remove it); the vLLM and router units
require it, so they never listen without it. A new plan (a host added, a port moved) rewrites it
and reloads the unit (one nft transaction; a restart would restart every unit that requires it).
Whatever nftables.service does later (start, restart, stop, reload: each flushes the whole ruleset),
a drop-in of glm-infra's for it loads the table again right after, while glm-infra's unit is active
(``nftables_dropin``); the firewall unit itself is never restarted for it.
The step's check compares the live table with what this module renders (``LIVE``) and that systemd
runs nftables.service with that drop-in: a table flushed, edited or deleted by hand fails it, and
``apply`` loads the table again. ``destroy`` deletes the table and the drop-in. Pure: the per-host
plan takes ``step``.
"""

from __future__ import annotations

import functools

from glm_infra import render
from glm_infra.plan import ports
from glm_infra.plan.topology import HostPlan, Plan
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import RenderedFile, Step

TABLE = "inet glm_infra"
UNIT = "glm-infra-firewall.service"
RULESET = f"{paths.ETC}/firewall.nft"
LIVE = paths.script("firewall-live")  # compares the live table with the ruleset on its stdin
NFTABLES_UNIT = "nftables.service"  # the distribution's
NFTABLES_DROPIN = paths.dropin(NFTABLES_UNIT)
SSH = "ssh"


def _split(addresses: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The IPv4 and IPv6 networks of ``addresses``, each once and none inside another (nft refuses an
    interval set whose elements overlap: a host inside a listed CIDR). Every host's ruleset asks the same
    few lists (quadratic in their length: 96 hosts asked 1.8 million containments): each is worked out once."""
    return _split_once(tuple(addresses))


@functools.lru_cache(maxsize=256)
def _split_once(addresses: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    nets = set()
    for a in addresses:
        net = ports.network(a)
        if net is None:
            raise ValueError(f"{a!r} is not an IP address or network: the firewall cannot use a DNS name")
        nets.add(net)
    kept = [n for n in nets if not any(n != m and n.version == m.version and n.subnet_of(m) for m in nets)]
    return (tuple(str(n) for n in sorted(n for n in kept if n.version == 4)),
            tuple(str(n) for n in sorted(n for n in kept if n.version == 6)))


def audiences(stack: StackConfig) -> dict[str, list[str]]:
    """Who may reach each kind of port: SSH from the admin networks and the stack's hosts, the plan's
    ports from the stack's hosts, the public ones also from the stack's CIDRs. A list left unset (which
    validate refuses where it matters) lets nobody else in: never everyone by default."""
    peers = [h.address for h in stack.hosts]
    r = stack.router
    return {
        SSH: peers + list(stack.firewall.admin_cidrs or ()),
        ports.PEERS: peers,
        ports.ROUTER: peers + list((r.allowed_cidrs or ()) if r is not None else ()),
        ports.OPERATORS: peers + list(stack.monitoring.allowed_cidrs),
    }


def ruleset(stack: StackConfig, plan: Plan, host: str) -> str:
    """The table for ``host``: per audience, a set of who may connect and the TCP ports they may reach;
    the chain drops the rest."""
    mine = [li for li in ports.listeners(stack, plan.serve) if li.host == host]
    ssh_port = stack.host(host).ssh_port
    body: list[str] = []
    rules: list[str] = []
    for audience, who in audiences(stack).items():
        theirs = [li for li in mine if li.audience == audience]
        if audience != SSH and not theirs:
            continue
        port_list = [ssh_port] if audience == SSH else sorted({li.port for li in theirs})
        numbers = f"{{ {', '.join(str(p) for p in port_list)} }}"
        # For whoever reads the file: what listens there.
        what = f"sshd on {ssh_port}" if audience == SSH else ", ".join(sorted({li.owner for li in theirs}))
        v4, v6 = _split(who)
        for family, kind, members in (("v4", "ipv4_addr", v4), ("v6", "ipv6_addr", v6)):
            elements = f" elements = {{ {', '.join(members)} }}" if members else ""
            body.append(f"\tset {audience}_{family} {{ type {kind}; flags interval;{elements} }}")
        rules.extend([f"\t\t# {audience}: {what}",
                      f"\t\ttcp dport {numbers} ip saddr @{audience}_v4 accept",
                      f"\t\ttcp dport {numbers} ip6 saddr @{audience}_v6 accept"])
        if audience != SSH:  # glm-infra's own ports answer "refused"; SSH stays silent like the rest
            rules.append(f"\t\ttcp dport {numbers} reject with tcp reset")
    # Comments are for whoever reads the file (nft drops them): their wording is not mutated.
    return "\n".join([
        f"# Managed by glm-infra: who may reach {host} (glm-infra's ports: the stack's hosts and the CIDRs the",
        "# stack lists for its public ports; SSH: firewall.adminCidrs and the stack's hosts); everything else",  # pragma: no mutate
        "# is dropped. Loaded by glm-infra-firewall.service at boot, before the network.",  # pragma: no mutate
        f"table {TABLE}", f"delete table {TABLE}", f"table {TABLE} {{", *body,
        "\tchain input {", "\t\ttype filter hook input priority filter - 5; policy accept;",
        '\t\tiifname "lo" accept', "\t\tct state established,related accept",
        "\t\tmeta l4proto { icmp, ipv6-icmp } accept",
        "\t\t# the host's address lease (DHCPv6 answers from a link-local address, which conntrack cannot pair)",  # pragma: no mutate
        "\t\tudp sport 67 udp dport 68 accept", "\t\tip6 saddr fe80::/10 udp sport 547 udp dport 546 accept",
        *rules, *_vrrp(plan, host),
        # A last rule rather than the chain's policy: the same for every packet, but a table flushed by hand
        # (rules gone, chain kept) leaves the host reachable over SSH, and the step's check sees the flush.
        "\t\t# anything else",  # pragma: no mutate
        "\t\tdrop", "\t}", "}", ""])


def _vrrp(plan: Plan, host: str) -> list[str]:
    """keepalived's adverts (IP protocol 112, unicast) from the other router hosts, when they share an address."""
    r = plan.router
    if r is None or not r.virtual or host not in r.host_names or not r.peers(host):
        return []
    return ["\t\t# vrrp: keepalived's adverts from the other router hosts (the virtual address)",  # pragma: no mutate
            f"\t\tip protocol vrrp ip saddr {{ {', '.join(p.address for p in r.peers(host))} }} accept"]


LOAD = f"/usr/sbin/nft -f {RULESET}"  # one nft transaction: the table deleted and made again (ruleset())
# What nftables.service runs after each of its own commands: the table again, while this unit is active (at
# boot it is not yet: it starts after nftables.service and loads the table itself; stopped, it owns none).
LOAD_IF_ACTIVE = f"/bin/sh -c 'if systemctl is-active --quiet {UNIT}; then exec {LOAD}; fi'"


def unit() -> str:
    return (
        "# Managed by glm-infra: its nftables table, loaded before the network comes up (no DNS needed:\n"  # pragma: no mutate
        "# addresses only), after the distribution's nftables.service (its ruleset may flush everything).\n"  # pragma: no mutate
        "# The vLLM and router units require this one. Reloaded, never restarted: a restart would\n"  # pragma: no mutate
        f"# restart them too. Whatever nftables.service does later, {NFTABLES_DROPIN} loads the table again.\n"  # pragma: no mutate
        "[Unit]\nDescription=glm-infra firewall: nftables table inet glm_infra (glm-infra's ports for the stack's hosts, "
        "SSH, nothing else)\n"  # pragma: no mutate
        f"DefaultDependencies=no\nWants=network-pre.target\nAfter={NFTABLES_UNIT}\n"
        "Before=network-pre.target shutdown.target\nConflicts=shutdown.target\n\n"
        "[Service]\nType=oneshot\nRemainAfterExit=yes\n"
        f"ExecStart={LOAD}\nExecReload={LOAD}\n"
        f"ExecStop=-/usr/sbin/nft delete table {TABLE}\n\n[Install]\nWantedBy=sysinit.target\n"
    )


def nftables_dropin() -> str:
    """The drop-in for the distribution's nftables.service. Debian 12's (nftables 1.0.6-2+deb12u2,
    /lib/systemd/system/nftables.service, read from the package) runs ``ExecStart=`` and ``ExecReload=/usr/sbin/nft
    -f /etc/nftables.conf`` (whose default first line is ``flush ruleset``) and ``ExecStop=/usr/sbin/nft flush
    ruleset``; Ubuntu 24.04 ships Debian's packaging rebuilt (1.0.9-1build1; its unit not read here, this machine's
    apt reaches Debian only), and the drop-in holds whatever its commands are. So ``restart`` (stop, then
    start), ``stop``, ``start`` and ``reload`` each remove every table, ours too, while the firewall unit stays
    active: ``ReloadPropagatedFrom=`` would cover reloads only, and ``PartOf=`` would restart the firewall unit,
    and with it every vLLM and router unit (they require it). systemd runs these after nftables.service's own
    commands: ``ExecStartPost=`` after a start (a restart's too), ``ExecStopPost=`` after a stop and after a start
    that failed, an added ``ExecReload=`` after the distribution's reload."""
    return (
        "# Managed by glm-infra: the table inet glm_infra loaded again after whatever nftables.service does (each\n"  # pragma: no mutate
        f"# of its commands flushes the whole ruleset), while {UNIT} is active.\n"  # pragma: no mutate
        f"[Service]\nExecStartPost={LOAD_IF_ACTIVE}\nExecReload={LOAD_IF_ACTIVE}\n"
        f"ExecStopPost={LOAD_IF_ACTIVE}\n"
    )


def live_script() -> str:
    return render.render_template("firewall-live.sh.j2", table=TABLE, nftables_unit=NFTABLES_UNIT)


def step(stack: StackConfig, plan: Plan, h: HostPlan) -> Step | None:
    if not stack.firewall.enabled:
        return None
    return render.package_service_step(
        "firewall", f"nftables table {TABLE}: glm-infra's ports for the stack's hosts, SSH, nothing else",  # pragma: no mutate
        h.name,
        ["nftables"], [UNIT], [],
        [RenderedFile(RULESET, ruleset(stack, plan, h.name)), RenderedFile(paths.unit(UNIT), unit()),
         RenderedFile(NFTABLES_DROPIN, nftables_dropin()), RenderedFile(LIVE, live_script(), 0o755)],
        config_check=f"nft -c -f {RULESET}",
        # What the plan renders (the step's own copy, not the file on disk) against what is loaded, and
        # the drop-in as systemd runs nftables.service.
        live_check=f"content {RULESET} | {LIVE} {NFTABLES_DROPIN}", reload=True)
