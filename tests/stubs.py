"""A stub PATH for host-script tests: each stub records its arguments and answers from a scenario; and a
private root to run a script in (`isolated`): the system folders it writes are temporary ones."""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# This machine's boot id, as the reboot scripts read it (/proc is not stubbed).
BOOT = Path("/proc/sys/kernel/random/boot_id").read_text().strip()


# systemctl for the driver step's units, its state under $STATE: Ubuntu's nvidia-persistenced unit is static;
# the fabric manager's precheck refuses without ib_umad (the driver step's tests in test_host_scripts.py and
# test_package_semantics.py).
DRIVER_SYSTEMCTL = r"""u=${!#}; u=${u%.service}
mkdir -p "$STATE/enabled" "$STATE/active"
case "$1" in
  list-unit-files|daemon-reload|status) exit 0 ;;
  is-enabled) if [ -e "$STATE/enabled/$u" ]; then echo enabled; elif [ "$u" = nvidia-persistenced ]; then echo static; else echo disabled; exit 1; fi ;;
  is-active) [ -e "$STATE/active/$u" ] ;;
  enable) touch "$STATE/enabled/$u" ;;
  add-wants) mkdir -p /etc/systemd/system/multi-user.target.wants
             ln -sf "/lib/systemd/system/$u.service" "/etc/systemd/system/multi-user.target.wants/$u.service" ;;
  start) if [ "$u" = nvidia-fabricmanager ] && [ ! -e "$STATE/modules/ib_umad" ]; then
           echo 'Kernel module "ib_umad" has not been loaded, fabric manager cannot be started' >&2; exit 1; fi
         touch "$STATE/active/$u" ;;
esac"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    calls: list[str]  # "cmd arg arg" per stub call, in order

    def called(self, prefix: str) -> bool:
        return any(c.startswith(prefix) for c in self.calls)


class StubPath:
    """A folder of fake commands. ``add(name, body)``: body is bash run after the call is logged;
    ``$STATE`` is a folder the stubs and the test share."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.state = root / "state"
        self.log = root / "calls.log"
        self.bin.mkdir(parents=True, exist_ok=True)
        self.state.mkdir(exist_ok=True)

    def add(self, name: str, body: str = "exit 0") -> None:
        p = self.bin / name
        p.write_text(f'#!/bin/bash\nprintf "%s\\n" "{name} $*" >> "$STUB_LOG"\n{body}\n')
        p.chmod(0o755)

    def run(self, script: Path | str, *args: str, env: dict | None = None, timeout: int = 60) -> Result:
        self.log.write_text("")
        e = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "STUB_LOG": str(self.log),
            "STATE": str(self.state),
            "LC_ALL": "C",
        }
        e.update(env or {})
        if isinstance(script, Path):
            cmd = ["bash", str(script), *args]
            stdin = None
        else:
            cmd = ["bash", "-s", "--", *args]
            stdin = script
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=e, timeout=timeout)
        calls = [l for l in self.log.read_text().splitlines() if l]
        return Result(p.returncode, p.stdout, p.stderr, calls)


def isolated(stubs: StubPath, script: str, args: list[str], dirs: list[str], tmp: Path) -> Result:
    """Run script in a mount namespace where each of dirs is a persistent temporary folder."""
    binds = []
    for d in dirs:
        src = tmp / "root" / d.lstrip("/")
        src.mkdir(parents=True, exist_ok=True)
        binds.append(f"mkdir -p {shlex.quote(d)} && mount --bind {shlex.quote(str(src))} {shlex.quote(d)}")
    (tmp / "script.sh").write_text(script)
    inner = " && ".join(binds + [f"exec bash {tmp / 'script.sh'} {' '.join(shlex.quote(a) for a in args)}"])
    return stubs.run(f"unshare --mount --propagation private bash -c {shlex.quote(inner)}\n",
                     env={"PATH": f"{stubs.bin}:/usr/sbin:/usr/bin:/sbin:/bin"})


def in_root(tmp: Path, path: str) -> Path:
    return tmp / "root" / path.lstrip("/")


def _shellcheck_exe() -> str:
    exe = Path(sys.executable).parent / "shellcheck"
    return str(exe) if exe.exists() else "shellcheck"


def shellcheck(text: str, tmp: Path, name: str = "script.sh") -> subprocess.CompletedProcess:
    p = tmp / name
    p.write_text(text)
    return subprocess.run([_shellcheck_exe(), "-s", "bash", str(p)], capture_output=True, text=True)


_SHELLCHECKED: dict[str, list[str]] = {}  # text: shellcheck's findings (none: clean), for this test process


def shellcheck_each(scripts: dict[str, str], tmp: Path) -> dict[str, str]:
    """shellcheck's findings for each of ``scripts`` (label: text) that has any, by label: each distinct text
    checked once in this test process (many stacks render the same scripts), the new ones in one shellcheck run."""
    new = sorted(set(scripts.values()) - set(_SHELLCHECKED))
    files = {}
    for i, text in enumerate(new):
        files[str(tmp / f"script-{i}.sh")] = text
        (tmp / f"script-{i}.sh").write_text(text)
    if files:
        r = subprocess.run([_shellcheck_exe(), "-s", "bash", "-f", "gcc", *files], capture_output=True, text=True)
        found: dict[str, list[str]] = {}
        for line in r.stdout.splitlines():
            path, _, rest = line.partition(":")
            found.setdefault(path, []).append(rest)
        # Any other failure (shellcheck missing, a file it could not read) is one too: never a silent pass.
        assert r.returncode in (0, 1) and (r.returncode == 0) == (not found), (r.returncode, r.stdout, r.stderr)
        assert set(found) <= set(files), f"shellcheck named files it was not given: {sorted(set(found) - set(files))}"
        _SHELLCHECKED.update({text: found.get(path, []) for path, text in files.items()})
    return {label: "\n".join(_SHELLCHECKED[text]) for label, text in scripts.items() if _SHELLCHECKED[text]}
