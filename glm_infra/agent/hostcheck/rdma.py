"""The RDMA NICs as ibv_devinfo, show_gids and ibstat describe them: ports, MTU, link layer and RoCE v2 GIDs."""

from __future__ import annotations

import ipaddress
import re


def parse_ibv_devinfo(text: str) -> dict[str, dict]:
    """``ibv_devinfo`` or ``ibv_devinfo -v``: {device: {port number: {state, active_mtu, link_layer,
    gids}}}, ``gids`` (from ``-v`` only) {index: {gid, ver, ipv4}}. Tabs or spaces alike."""
    out: dict[str, dict] = {}
    dev = port = None
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"^hca_id:\s*(\S+)", s)
        if m:
            dev = out.setdefault(m.group(1), {})
            port = None
            continue
        m = re.match(r"^port:\s*(\d+)", s)
        if m and dev is not None:
            port = dev.setdefault(int(m.group(1)), {"gids": {}})
            continue
        if port is None:
            continue
        m = re.match(r"^GID\[\s*(\d+)\]:\s*([0-9A-Fa-f:.]+)(?:,\s*RoCE (v\d))?$", s)
        if m:
            port["gids"][int(m.group(1))] = {"gid": m.group(2), "ver": m.group(3) or "", "ipv4": gid_ipv4(m.group(2))}
            continue
        key, _, value = s.partition(":")
        value = value.strip()
        if key == "state":
            port["state"] = value.split()[0] if value else ""
        elif key == "active_mtu" and value.split() and value.split()[0].isdigit():
            port["active_mtu"] = int(value.split()[0])
        elif key == "link_layer":
            port["link_layer"] = value
    return out


def gid_ipv4(gid: str) -> str:
    """The IPv4 address of an IPv4-mapped GID, in either form the tools print
    (``::ffff:10.0.3.1`` or ``0000:…:ffff:0a00:0301``); "" for any other GID."""
    try:
        mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    except ValueError:
        return ""
    return str(mapped) if mapped else ""


def parse_show_gids(text: str) -> list[dict[str, str]]:
    """``show_gids``: one dict per GID row (dev, port, index, gid, ipv4, ver, netdev)."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        # A row without a number for port and index is not a GID row (headers, rules, a mangled line).
        if len(parts) < 5 or not (parts[1].isdigit() and parts[2].isdigit()):
            continue
        dev, port, index, gid = parts[:4]
        rest = parts[4:]
        ipv4 = rest.pop(0) if rest and re.match(r"^\d+\.\d+\.\d+\.\d+$", rest[0]) else ""
        ver = rest[0] if rest else ""
        netdev = rest[1] if len(rest) > 1 else ""
        rows.append({"dev": dev, "port": port, "index": index, "gid": gid, "ipv4": ipv4, "ver": ver, "netdev": netdev})
    return rows


def parse_ibstat(text: str) -> dict[str, dict]:
    """``ibstat``: {CA: {type, firmware, ports: {number: {state, physical_state, rate, link_layer}}}}."""
    out: dict[str, dict] = {}
    ca = port = None
    keys = {"State": "state", "Physical state": "physical_state", "Rate": "rate", "Link layer": "link_layer",
            "Base lid": "base_lid"}
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"^CA '([^']+)'$", s)
        if m:
            ca = out.setdefault(m.group(1), {"ports": {}})
            port = None
            continue
        if ca is None:
            continue
        m = re.match(r"^Port (\d+):$", s)
        if m:
            port = ca["ports"].setdefault(int(m.group(1)), {})
            continue
        key, _, value = s.partition(":")
        value = value.strip()
        if port is None:
            if key == "CA type":
                ca["type"] = value
            elif key == "Firmware version":
                ca["firmware"] = value
        elif key in keys:
            port[keys[key]] = int(value) if key == "Rate" and value.isdigit() else value
    return out


def gid_table(devinfo: str, show_gids: str | None) -> dict[str, dict[int, dict[str, str]]]:
    """{device: {GID index: {gid, ver, ipv4}}} of port 1: from ``show_gids`` (DOCA-OFED's tool) when it
    ran, else from the GID lines of ``ibv_devinfo -v`` (inbox rdma-core has no show_gids)."""
    out: dict[str, dict[int, dict[str, str]]] = {}
    if show_gids is not None:
        for r in parse_show_gids(show_gids):
            if r["port"] == "1":
                out.setdefault(r["dev"], {})[int(r["index"])] = {"gid": r["gid"], "ver": r["ver"], "ipv4": r["ipv4"]}
    else:
        out = {dev: dict(ports[1]["gids"]) if 1 in ports else {} for dev, ports in parse_ibv_devinfo(devinfo).items()}
    # One spelling per GID (the tools print some compressed, some as eight groups).
    return {dev: {i: {**g, "gid": _canonical_gid(g["gid"])} for i, g in gids.items()} for dev, gids in out.items()}


def _canonical_gid(gid: str) -> str:
    try:
        return str(ipaddress.IPv6Address(gid))
    except ValueError:
        return gid
