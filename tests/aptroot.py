"""Host scripts against the stand-in apt repository with this machine's real apt: apt-get, apt-cache, apt-mark
and dpkg-query work on a private apt and dpkg state (bind mounts over /etc/apt, /var/lib/dpkg, /var/lib/apt,
/var/cache/apt and /usr/share/keyrings in a private mount namespace), so apt resolves every install as on a
host: Depends at exact versions, Conflicts, holds, preferences, a newer release in the repository. What apt
decides is not unpacked: an install runs as ``apt-get -s`` and its result (Inst, Remv, Purg) is written to
the dpkg status, with the apt preferences files the packages ship (the pinning packages'). No maintainer
script runs; the rest of the host (units, modules, nvidia-smi) is stubbed as in test_host_scripts.
Needs root (unshare, mount), apt and dpkg."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from stubs import Result, StubPath, isolated

APT_DIRS = ["/etc/apt", "/var/lib/dpkg", "/var/lib/apt", "/var/cache/apt", "/usr/share/keyrings"]
# What a host has before glm-infra installs anything, as far as the stand-ins depend on it.
BASE = {"python3": "3.11.2-1+b1"}

# Applies an ``apt-get -s`` transcript (stdin) to the dpkg status: argv[1] is the stand-in repository.
APPLY = r'''
import io, re, subprocess, sys, tarfile
from pathlib import Path

repo = Path(sys.argv[1])
status = Path("/var/lib/dpkg/status")
info = Path("/var/lib/dpkg/info")
KEEP = ("Package", "Status", "Priority", "Section", "Maintainer", "Architecture", "Version", "Provides", "Depends",
        "Pre-Depends", "Conflicts", "Breaks", "Replaces", "Description")


def stanzas(text):
    out = []
    for block in text.split("\n\n"):
        fields, key = {}, None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "Package" in fields:
            out.append(fields)
    return out


entries = {s["Package"]: s for s in stanzas(status.read_text())}
for line in sys.stdin.read().splitlines():
    m = re.match(r"^(Inst|Remv|Purg) (\S+)(?: \[[^\]]*\])?(?: \((\S+) )?", line)
    if not m:
        continue
    what, name, version = m.groups()
    for f in (info / f"{name}.list").read_text().splitlines() if (info / f"{name}.list").exists() else []:
        Path(f).unlink(missing_ok=True)
    if what != "Inst":
        entries.pop(name, None)
        (info / f"{name}.list").unlink(missing_ok=True)
        continue
    record = subprocess.run(["apt-cache", "show", f"{name}={version}"], capture_output=True, text=True,
                            check=True).stdout
    fields = stanzas(record)[0]
    held = entries.get(name, {}).get("Status", "").startswith("hold")
    entries[name] = {k: ("hold ok installed" if held else "install ok installed") if k == "Status" else fields[k]
                     for k in KEEP if k in fields or k == "Status"}
    # The one kind of file that matters to apt: the preferences a package ships (NVIDIA's pinning packages').
    owned = []
    deb = next(p for p in (repo / fields["Filename"], repo / "doca" / fields["Filename"]) if p.is_file())
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for member in t.getmembers():
            path = "/" + member.name.lstrip("./")
            if member.isfile() and path.startswith("/etc/apt/preferences.d/"):
                Path(path).write_bytes(t.extractfile(member).read())
                owned.append(path)
    (info / f"{name}.list").write_text("".join(p + "\n" for p in owned))
status.write_text("".join("".join(f"{k}: {v}\n" for k, v in e.items()) + "\n" for e in entries.values()))
'''

# apt-get: everything but a real install or removal as it is; those simulated, then applied.
APT_GET = '''real=/usr/bin/apt-get
act=0
for a; do case "$a" in -s|--simulate|--just-print|--dry-run|--no-act) exec "$real" "$@" ;;
  install|remove|purge|reinstall) act=1 ;; esac; done
[ "$act" = 1 ] || exec "$real" "$@"
out=$("$real" -s "$@" 2>&1) || { printf '%s\\n' "$out" >&2; exit 100; }
printf '%s\\n' "$out" | {python} {apply} {repo}'''


class AptRoot:
    """A host's apt and dpkg state in ``tmp`` (empty but for BASE), installing from the stand-in repository
    ``repo`` (its apt/ folder, holding doca/)."""

    def __init__(self, tmp: Path, repo: Path) -> None:
        self.tmp, self.repo = tmp, repo
        self.stubs = StubPath(tmp / "stubs")
        root = tmp / "root"
        for d in ("etc/apt/sources.list.d", "etc/apt/preferences.d", "etc/apt/apt.conf.d", "etc/apt/trusted.gpg.d",
                  "var/lib/dpkg/info", "var/lib/dpkg/updates", "var/lib/apt/lists/partial",
                  "var/cache/apt/archives/partial", "usr/share/keyrings"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "var/lib/dpkg/available").touch()
        (root / "var/lib/dpkg/status").write_text("".join(
            f"Package: {p}\nStatus: install ok installed\nPriority: optional\nMaintainer: Debian\n"
            f"Architecture: amd64\nVersion: {v}\nDescription: base system\n\n" for p, v in BASE.items()))
        # The test's folders are private to root: apt reads them as root, not as _apt.
        (root / "etc/apt/apt.conf.d/00glm-infra-test").write_text('APT::Sandbox::User "root";\n')
        (tmp / "apply.py").write_text(APPLY)
        self.stubs.add("apt-get", APT_GET.replace("{python}", sys.executable).replace("{apply}", str(tmp / "apply.py"))
                       .replace("{repo}", str(repo)))
        # gpg (dearmoring the repository's key) with a home of its own, not root's.
        (tmp / "gnupg").mkdir(mode=0o700)
        self.stubs.add("gpg", f'GNUPGHOME={tmp / "gnupg"} exec {shutil.which("gpg")} "$@"')

    def run(self, script: str, args: list[str], dirs: list[str]) -> Result:
        return isolated(self.stubs, script, args, APT_DIRS + dirs, self.tmp)

    def installed(self) -> dict[str, str]:
        """Package -> version of what the host has installed (its dpkg status)."""
        out, name = {}, None
        for line in (self.tmp / "root/var/lib/dpkg/status").read_text().splitlines():
            if line.startswith("Package: "):
                name = line.split(": ", 1)[1]
            elif line.startswith("Version: ") and name:
                out[name] = line.split(": ", 1)[1]
        return out

    def held(self) -> set[str]:
        out, name = set(), None
        for line in (self.tmp / "root/var/lib/dpkg/status").read_text().splitlines():
            if line.startswith("Package: "):
                name = line.split(": ", 1)[1]
            elif line.startswith("Status: hold"):
                out.add(name)
        return out
