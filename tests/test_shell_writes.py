"""Writes whose failure a caller cannot mask (issue 25, defect 7, and its class).

The `put` / `put_cmd` contract of glm_infra/templates/_put.sh.j2 (docs: its header), run for real
against this machine's filesystem; every template read for a call of put (or of a function calling it)
where bash turns errexit off or runs it in a subshell (testbed/shellscan.py); and the other writes of the
host scripts whose failure used to be masked by `|| true` (package-service's files, removal, service.sh's
remove, the front's purge, the boot check's marker)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import stack_file
from stubs import BOOT, StubPath, in_root, isolated, shellcheck

from glm_infra import render
from glm_infra.roles import drivers, router
from glm_infra.stack import load_file
from glm_infra.steps import RenderedFile
from testbed.shellscan import masked_writes

ROOT = Path(__file__).resolve().parent.parent
PROD = load_file(stack_file("prod-b300")).config
HOST = "b300-1"

# What every template including _put.sh.j2 defines first (log and fail, the way the host scripts do).
PRELUDE = """#!/usr/bin/env bash
set -euo pipefail
log() { printf 'h: %s\\n' "$*"; }
fail() { printf 'h: %s\\n' "$*" >&2; exit 1; }
"""


def put_script(body: str) -> str:
    return render._ENV.from_string(PRELUDE + '{% include "_put.sh.j2" %}\n' + body).render()


def bash(script: str, tmp: Path) -> subprocess.CompletedProcess:
    f = tmp / "s.sh"
    f.write_text(script)
    return subprocess.run(["bash", str(f)], capture_output=True, text=True, timeout=30, cwd=tmp,
                          env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})


# --- the put contract ----------------------------------------------------------------------------


def test_put_to_an_unwritable_path_stops_the_script_naming_it(tmp_path):
    """The issue's demonstration: `put` under && used to log "wrote" and set changed."""
    for call in ('put /proc/version/f <<<x', 'put /proc/version/f <<<x && changed=1', 'set +e; put /proc/version/f <<<x'):
        r = bash(put_script(f'changed=0\n{call}\necho "after changed=$changed"\n'), tmp_path)
        assert r.returncode == 1, (call, r.stdout, r.stderr)
        assert "cannot write /proc/version/f" in r.stderr, call
        assert "wrote" not in r.stdout and "after" not in r.stdout, call


def test_put_cmd_whose_command_fails_leaves_no_file(tmp_path):
    """`false | put keyring.gpg` left a 0-byte keyring (the shape of `gpg --dearmor | put`)."""
    keyring = tmp_path / "keys" / "keyring.gpg"
    r = bash(put_script(f'put_cmd {keyring} 0644 -- false\necho after\n'), tmp_path)
    assert r.returncode == 1 and "after" not in r.stdout
    assert f"cannot write {keyring}: false failed (exit 1)" in r.stderr
    assert not keyring.exists() and list(keyring.parent.iterdir()) == [], "no keyring, no temporary file left"
    # A shell function as the command: a failing line in it counts, not only its last one.
    r = bash(put_script(f'half() {{ echo part; false; echo rest; }}\nput_cmd {keyring} 0644 -- half\necho after\n'), tmp_path)
    assert r.returncode == 1 and "half failed" in r.stderr and not keyring.exists()
    # And a keyring that was there stays as it was.
    keyring.write_bytes(b"OLD KEY")
    r = bash(put_script(f'put_cmd {keyring} 0644 -- false\n'), tmp_path)
    assert r.returncode == 1 and keyring.read_bytes() == b"OLD KEY"


def test_put_cmd_writes_what_the_command_prints(tmp_path):
    f = tmp_path / "k.gpg"
    src = tmp_path / "key.asc"
    src.write_text("PUBLIC KEY\n")
    r = bash(put_script(f'changed=0\nput_cmd {f} 0640 -- cat {src}\necho "changed=$changed"\n'
                        f'changed=0\nput_cmd {f} 0640 -- cat {src}\necho "changed=$changed"\n'), tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"h: wrote {f}", "changed=1", "changed=0"]
    assert f.read_text() == "PUBLIC KEY\n" and oct(f.stat().st_mode)[-3:] == "640"


def test_put_changes_only_what_differs(tmp_path):
    f = tmp_path / "conf"
    f.write_text("a\n")
    f.chmod(0o644)
    os.utime(f, (1_000_000_000, 1_000_000_000))
    inode = f.stat().st_ino
    same = bash(put_script(f'changed=0\nput {f} <<<a\necho "changed=$changed"\n'), tmp_path)
    assert (same.returncode, same.stdout) == (0, "changed=0\n"), same.stderr
    assert f.stat().st_mtime == 1_000_000_000 and f.stat().st_ino == inode, "an unchanged file is not touched"

    with f.open() as reader:  # a reader of the old file keeps reading it: DEST is replaced, not rewritten
        r = bash(put_script(f'changed=0\nput {f} <<<b\necho "changed=$changed"\n'), tmp_path)
        assert r.returncode == 0 and r.stdout == f"h: wrote {f}\nchanged=1\n", r.stderr
        assert reader.read() == "a\n"
    assert f.read_text() == "b\n" and oct(f.stat().st_mode)[-3:] == "644"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary file left"

    # The same content with another mode: the mode changes, and that is a change.
    r = bash(put_script(f'changed=0\nput {f} 0600 <<<b\necho "changed=$changed"\n'), tmp_path)
    assert r.returncode == 0 and r.stdout.endswith("changed=1\n") and oct(f.stat().st_mode)[-3:] == "600"
    # A new file in a new folder, from a here-doc.
    new = tmp_path / "d" / "e" / "new"
    r = bash(put_script(f'put {new} 0755 <<EOF\nline one\nEOF\n'), tmp_path)
    assert r.returncode == 0 and new.read_text() == "line one\n" and oct(new.stat().st_mode)[-3:] == "755"


def test_put_refuses_a_folder_or_a_bad_mode(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    r = bash(put_script(f'put {d} <<<x\n'), tmp_path)
    assert r.returncode == 1 and f"cannot write {d}" in r.stderr and list(d.iterdir()) == []
    r = bash(put_script(f'put {tmp_path}/f 0x1 <<<x\n'), tmp_path)
    assert r.returncode == 1 and f"cannot write {tmp_path}/f: mode '0x1' is not octal" in r.stderr
    assert not (tmp_path / "f").exists()


def bash_read_only(script: str, tmp: Path, read_only: Path) -> subprocess.CompletedProcess:
    """``script`` in a private mount namespace where ``read_only`` (a folder or a file) is mounted read-only."""
    f = tmp / "s.sh"
    f.write_text(script)
    ro = str(read_only)
    inner = f"mount --bind '{ro}' '{ro}' && mount -o remount,bind,ro '{ro}' && exec bash '{f}'"
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", inner],
                          capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})


def test_put_says_which_part_of_the_write_failed(tmp_path):
    """One message naming DEST and the step that failed, with errexit on or off."""
    for errexit in ("", "set +e\n"):
        r = bash(put_script(f"{errexit}put /proc/version/f <<<x\n"), tmp_path)
        assert (r.returncode, r.stderr) == (1, "h: cannot write /proc/version/f: cannot create the folder /proc/version\n")
        r = bash(put_script(f"{errexit}put_cmd /proc/version/f 0644 -- echo x\n"), tmp_path)
        assert (r.returncode, r.stderr) == (1, "h: cannot write /proc/version/f: cannot create the folder /proc/version\n")
    # A folder that cannot take a new file (read-only).
    ro = tmp_path / "ro"
    ro.mkdir()
    r = bash_read_only(put_script(f"put {ro}/f <<<x\necho after\n"), tmp_path, ro)
    assert (r.returncode, r.stderr, r.stdout) == (1, f"h: cannot write {ro}/f: cannot create a file in {ro}\n", "")
    # Input that cannot be read (a folder as stdin): nothing is written.
    r = bash(put_script(f"put {tmp_path}/g < /\n"), tmp_path)
    assert r.returncode == 1 and f"cannot write {tmp_path}/g: writing {tmp_path}/.g.glm-infra." in r.stderr
    assert not (tmp_path / "g").exists() and not list(tmp_path.glob(".g.*"))
    # A file whose mode cannot change (read-only), its content already right.
    f = tmp_path / "same"
    f.write_text("x\n")
    f.chmod(0o644)
    r = bash_read_only(put_script(f"put {f} 0600 <<<x\necho after\n"), tmp_path, f)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.endswith(f"h: cannot set the mode of {f} to 0600\n")


def test_put_cmd_refuses_a_call_without_its_command(tmp_path):
    for call in ("put_cmd {f} 0644 false", "put_cmd {f} 0644 --"):
        r = bash(put_script(call.format(f=tmp_path / "k") + "\necho after\n"), tmp_path)
        assert r.returncode == 1 and "usage: put_cmd DEST MODE -- CMD ARG..." in r.stderr and "after" not in r.stdout
        assert not (tmp_path / "k").exists()


def test_put_is_shellcheck_clean(tmp_path):
    r = shellcheck(put_script('put /tmp/x <<<y\nput_cmd /tmp/y 0600 -- echo z\n'), tmp_path)
    assert r.returncode == 0, r.stdout


# --- no template calls put where a failure is masked ---------------------------------------------

MASKED = {
    "pipe": "echo x | put /f",
    "and": "put /f <<<x && changed=1",
    "or": "put /f <<<x || true",
    "if": "if put /f <<<x; then :; fi",
    "not": "! put /f <<<x",
    "while": "while put_cmd /f 0644 -- true; do :; done",
    "subst": 'x=$(put /f <<<y)',
    "quoted subst": 'log "$(put /f <<<y)"',
    "group": "{ echo a; put /f <<<x; } || true",
    "continued": "gpg --dearmor < k |\n  put /f",
    "function": "w() {\n  put /f <<<x\n}\nw || true",
    "before the final": "[ -e x ] && put /f <<<y || true",
    "function in if": "w() { put /f <<<x; }\nv() { w; }\nif v; then :; fi",
}
PLAIN = [
    "put /f <<<x",
    'put "$f" 0600 <<EOF\na && b | c\nEOF',
    "if [ -e x ]; then put /f <<<y; fi",
    "put_cmd /f 0644 -- gpg --dearmor k",
    "case $1 in\n  a) put /f <<<x ;;\nesac",
    "# put /f || true",
    'echo "put /f || true"',
    "output=x && input=y",
    "w() { put /f <<<x; }\nw",
    '[ "$mode" = verify ] || put /f <<<x',  # the command after the final ||: errexit holds in it
]


@pytest.mark.parametrize("case", sorted(MASKED))
def test_the_scan_sees_each_masked_form(case):
    assert masked_writes(MASKED[case]), case


@pytest.mark.parametrize("text", PLAIN)
def test_the_scan_leaves_plain_calls_alone(text):
    assert masked_writes(text) == []


def test_no_template_calls_put_where_a_failure_could_be_masked():
    found = [f"{t.relative_to(ROOT)}:{line}: {why}"
             for t in render.template_files() for line, why in masked_writes(t.read_text())]
    assert found == [], "put/put_cmd must be a plain command (see _put.sh.j2):\n" + "\n".join(found)


# --- package-service.sh: its files through put_cmd, its removal --------------------------------

PKG_DIRS = ["/etc/glm-test", "/var/lib/glm-infra"]


def package_service(files: list[RenderedFile]) -> str:
    return render.package_service_step("testsvc", "a test service", HOST, ["testpkg"], ["testsvc.service"], [],
                                       files).stdin


@pytest.fixture
def pkg_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    s.add("dpkg-query", "echo 'install ok installed'")
    s.add("apt-get", '[ -e "$STATE/purge-fails" ] && [ "$1" = purge ] && { echo "E: dpkg was interrupted"; exit 100; }; exit 0')
    s.add("systemctl", '''case "$1" in is-active) [ -e "$STATE/active" ] ;; restart|start) touch "$STATE/active" ;;
  list-unit-files) [ -e "$STATE/unit" ] ;; disable) [ ! -e "$STATE/stop-fails" ] ;; *) exit 0 ;; esac''')
    return s


def test_package_service_writes_its_files_once_with_their_modes(pkg_stubs, tmp_path):
    files = [RenderedFile("/etc/glm-test/a.conf", "a = 1\n"), RenderedFile("/etc/glm-test/sub/key", "k\n\n", 0o600)]
    script = package_service(files)
    r = isolated(pkg_stubs, script, ["apply"], PKG_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    a, key = in_root(tmp_path, "/etc/glm-test/a.conf"), in_root(tmp_path, "/etc/glm-test/sub/key")
    assert (a.read_text(), key.read_text()) == ("a = 1\n", "k\n\n"), "the content byte for byte"
    assert oct(a.stat().st_mode)[-3:] == "644" and oct(key.stat().st_mode)[-3:] == "600"
    os.utime(a, (1_000_000_000, 1_000_000_000))
    again = isolated(pkg_stubs, script, ["apply"], PKG_DIRS, tmp_path)
    assert again.returncode == 0 and "wrote" not in again.stdout and a.stat().st_mtime == 1_000_000_000
    assert isolated(pkg_stubs, script, ["check"], PKG_DIRS, tmp_path).returncode == 0
    key.chmod(0o644)  # readable by all behind glm-infra's back: check says so, apply puts it back
    c = isolated(pkg_stubs, script, ["check"], PKG_DIRS, tmp_path)
    assert c.returncode == 1 and "/etc/glm-test/sub/key is mode 644, glm-infra wrote 600" in c.stderr
    assert isolated(pkg_stubs, script, ["apply"], PKG_DIRS, tmp_path).returncode == 0
    assert oct(key.stat().st_mode)[-3:] == "600"


def test_package_service_stops_on_a_file_it_cannot_write(pkg_stubs, tmp_path):
    files = [RenderedFile("/etc/glm-test/sub/key", "k\n", 0o600)]
    in_root(tmp_path, "/etc/glm-test").mkdir(parents=True)
    in_root(tmp_path, "/etc/glm-test/sub").write_text("a file where the folder should be\n")
    r = isolated(pkg_stubs, package_service(files), ["apply"], PKG_DIRS, tmp_path)
    assert r.returncode == 1 and "cannot write /etc/glm-test/sub/key" in r.stderr
    assert "wrote" not in r.stdout and not r.called("systemctl restart"), "nothing starts on a file not written"


def test_package_service_removal_that_fails_says_so(pkg_stubs, tmp_path):
    script = package_service([RenderedFile("/etc/glm-test/a.conf", "a\n")])
    marker = in_root(tmp_path, "/var/lib/glm-infra/installed-testsvc")
    marker.parent.mkdir(parents=True)
    marker.touch()
    (pkg_stubs.state / "unit").touch()
    (pkg_stubs.state / "stop-fails").touch()
    r = isolated(pkg_stubs, script, ["remove"], PKG_DIRS, tmp_path)
    assert r.returncode == 1 and f"{HOST}: testsvc: could not stop and disable testsvc" in r.stderr
    (pkg_stubs.state / "stop-fails").unlink()
    (pkg_stubs.state / "purge-fails").touch()
    r = isolated(pkg_stubs, script, ["remove"], PKG_DIRS, tmp_path)
    assert r.returncode == 1 and "apt-get purge testpkg failed: E: dpkg was interrupted" in r.stderr
    assert "removed testpkg" not in r.stdout and marker.exists(), "a later remove tries again"
    (pkg_stubs.state / "purge-fails").unlink()
    (pkg_stubs.state / "unit").unlink()  # the package took its unit with it: nothing to stop
    r = isolated(pkg_stubs, script, ["remove"], PKG_DIRS, tmp_path)
    assert r.returncode == 0 and "removed testpkg" in r.stdout and not marker.exists()
    assert not r.called("systemctl disable")


def test_router_front_removal_that_fails_says_so(tmp_path):
    from glm_infra.plan.topology import plan

    s = StubPath(tmp_path / "stubs")
    s.add("apt-get", 'echo "E: Could not get lock /var/lib/dpkg/lock-frontend"; exit 100')
    s.add("systemctl")
    marker = in_root(tmp_path, "/var/lib/glm-infra-front/installed-nginx")
    marker.parent.mkdir(parents=True)
    marker.touch()
    r = isolated(s, router.router_front_script(PROD, plan(PROD)), ["remove"], ["/var/lib/glm-infra-front", "/etc/nginx"], tmp_path)
    assert r.returncode == 1 and "apt-get purge nginx failed: E: Could not get lock" in r.stderr
    assert marker.exists() and "removed nginx" not in r.stdout


# --- the boot check: a marker it cannot read is not a reboot ------------------------------------


def test_back_with_an_empty_boot_marker_does_not_call_it_a_reboot(tmp_path):
    s = StubPath(tmp_path / "stubs")
    s.add("systemctl")
    marker = in_root(tmp_path, "/var/lib/glm-infra/boot-before-reboot")
    marker.parent.mkdir(parents=True)
    marker.write_text("")  # the reboot step cut short while writing it
    r = isolated(s, drivers.back_script(HOST), [], ["/run/glm-infra", "/var/lib/glm-infra"], tmp_path)
    assert r.returncode == 1 and "rebooted" not in r.stdout
    assert f"{HOST}: whether the host rebooted is unknown" in r.stderr and "boot-before-reboot" in r.stderr
    assert marker.exists()
    marker.write_text(BOOT + "\n")
    assert isolated(s, drivers.back_script(HOST), [], ["/run/glm-infra", "/var/lib/glm-infra"], tmp_path).returncode == 1


def test_package_service_installs_restarts_on_change_and_gates_on_its_checks(tmp_path):
    """The rest of package-service.sh's apply and check: a missing package installed (apt-get update when
    the first try fails), a restart only when the configuration changed or the service is down, a
    configuration its checker refuses stops the step before any restart, URLs that do not answer and a
    live check that fails fail it, and check names each problem."""
    s = StubPath(tmp_path / "stubs")
    s.add("dpkg-query", '[ -e "$STATE/installed" ] && echo "install ok installed"; exit 0')
    s.add("apt-get", 'case "$1" in update) touch "$STATE/updated" ;; install) [ -e "$STATE/updated" ] || exit 100;'
                     ' touch "$STATE/installed" ;; esac')
    s.add("systemctl", 'case "$1" in is-active) [ -e "$STATE/active" ] || { [ "$2" = --quiet ] || echo inactive; exit 3; } ;;\n'
                       '  restart) touch "$STATE/active" ;; status) echo "   Active: failed" ;; esac; exit 0')
    s.add("curl", '[ -e "$STATE/up" ]')
    s.add("sleep", "exit 0")
    s.add("testcheck", '[ ! -e "$STATE/bad-config" ] || { echo "a.conf line 1: syntax error"; exit 1; }')
    s.add("testlive", '[ ! -e "$STATE/live-bad" ] || { echo "the live table differs"; exit 1; }')
    script = render.package_service_step(
        "testsvc", "a test service", HOST, ["testpkg"], ["testsvc.service"], ["http://127.0.0.1:9/ready"],
        [RenderedFile("/etc/glm-test/a.conf", "a = 1\n")], config_check="testcheck", live_check="testlive").stdin
    run = lambda action: isolated(s, script, [action], PKG_DIRS, tmp_path)  # noqa: E731
    (s.state / "up").touch()

    r = run("apply")
    assert r.returncode == 0, r.stderr
    assert [c.split()[1] for c in r.calls if c.startswith("apt-get")] == ["install", "update", "install"]
    assert in_root(tmp_path, "/var/lib/glm-infra/installed-testsvc").exists(), "purged on remove: glm-infra installed it"
    assert r.called("systemctl restart testsvc") and "testsvc running, http://127.0.0.1:9/ready answer" in r.stdout
    r = run("apply")
    assert r.returncode == 0 and not r.called("apt-get") and not r.called("systemctl restart")
    assert run("check").returncode == 0
    (s.state / "active").unlink()  # stopped behind glm-infra's back: the same configuration starts again
    c = run("check")
    assert c.returncode == 1 and f"{HOST}: testsvc: testsvc is inactive" in c.stderr
    assert run("apply").called("systemctl restart testsvc")

    (s.state / "up").unlink()
    c = run("check")
    assert c.returncode == 1 and "http://127.0.0.1:9/ready does not answer" in c.stderr
    r = run("apply")
    assert r.returncode == 1 and "http://127.0.0.1:9/ready do not answer after 60 s:  Active: failed" in r.stderr
    (s.state / "up").touch()

    (s.state / "bad-config").touch()
    r = run("apply")
    assert r.returncode == 1 and "the configuration is refused: a.conf line 1: syntax error" in r.stderr
    assert not r.called("systemctl")
    c = run("check")
    assert c.returncode == 1 and "the configuration on disk is refused: a.conf line 1: syntax error" in c.stderr
    (s.state / "bad-config").unlink()

    (s.state / "live-bad").touch()
    c = run("check")
    assert c.returncode == 1 and "the live table differs" in c.stderr
    r = run("apply")  # what runs is not what the files say: restarted, and still wrong: the step fails
    assert r.returncode == 1 and r.called("systemctl restart testsvc")
    assert "testsvc started, but: the live table differs" in r.stderr
    (s.state / "live-bad").unlink()

    (s.state / "installed").unlink()
    c = run("check")
    assert c.returncode == 1 and "not installed: testpkg" in c.stderr
    assert run("bogus").returncode == 2


def test_router_front_installs_nginx_loads_the_configuration_and_waits(tmp_path):
    from glm_infra.plan.topology import plan

    s = StubPath(tmp_path / "stubs")
    nginx = f'#!/bin/bash\necho "nginx $*" >> "$STUB_LOG"\n[ ! -e "$STATE/bad" ] || {{ echo "nginx: [emerg] unknown directive"; exit 1; }}\n'
    s.add("apt-get", f'case "$1" in update) touch "$STATE/updated" ;; install) [ -e "$STATE/updated" ] || exit 100\n'
                     f'  printf %s {shlex.quote(nginx)} > {s.bin}/nginx; chmod +x {s.bin}/nginx ;; esac')
    s.add("systemctl", 'case "$1" in is-active) [ -e "$STATE/active" ]; exit ;; start) touch "$STATE/active" ;; esac; exit 0')
    # The front answers from the third look on after a (re)load.
    s.add("curl", '[ -e "$STATE/down" ] && exit 7; n=$(cat "$STATE/looks" 2>/dev/null || echo 0); '
                  'echo $((n + 1)) > "$STATE/looks"; [ "$n" -ge 2 ]')
    s.add("sleep", "exit 0")
    s.add("sysctl", "exit 0")  # prod-b300's two routers: nginx listens on the virtual address too
    script = router.router_front_script(PROD, plan(PROD))
    # A host without nginx until the step installs it: the machine's own (scripts/lib/host-deps.sh installs it
    # for tests/test_front_door.py) is hidden behind an empty /usr/sbin.
    run = lambda action: isolated(s, script, [action], ["/var/lib", "/usr/sbin"], tmp_path)  # noqa: E731
    health = "https://10.0.0.13:8000/health"  # b300-3's own address: the virtual one may be on the other router host

    r = run("apply")
    assert r.returncode == 0, r.stderr
    assert [c.split()[1] for c in r.calls if c.startswith("apt-get")] == ["install", "update", "install"]
    assert "installed nginx" in r.stdout and f"{health} answers" in r.stdout
    assert r.called("nginx -t -q") and r.called("systemctl start nginx"), r.calls
    assert r.called("sysctl -q -w net.ipv4.ip_nonlocal_bind=1"), r.calls
    assert in_root(tmp_path, "/var/lib/glm-infra-front/installed-nginx").exists()
    (s.state / "looks").unlink()
    r = run("apply")
    assert r.returncode == 0 and not r.called("apt-get") and r.called("systemctl reload nginx")
    assert run("check").returncode == 0

    (s.state / "bad").touch()
    r = run("apply")
    assert r.returncode == 1 and "router front: nginx rejects the configuration" in r.stderr
    assert not r.called("systemctl reload")
    (s.state / "bad").unlink()
    (s.state / "down").touch()
    r = run("apply")
    assert r.returncode == 1 and f"router front: {health} does not answer;" in r.stderr
    c = run("check")
    assert c.returncode == 1 and f"{health} does not answer" in c.stderr
    assert run("bogus").returncode == 2
    r = run("remove")
    assert r.returncode == 0 and r.called("apt-get purge -y -q nginx nginx-common") and "removed nginx" in r.stdout
    assert not in_root(tmp_path, "/var/lib/glm-infra-front").exists()
