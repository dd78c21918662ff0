"""service.sh: start/restart a unit and gate on /health, against a stub PATH."""

from __future__ import annotations

import pytest

from glm_infra.render import render_template
from stubs import StubPath, shellcheck


def script(timeout_s: int = 6) -> str:
    return render_template(
        "service.sh.j2",
        host="b300-1",
        unit="glm-vllm-prefill-0.service",
        health_url="http://10.0.0.11:8100/health",
        timeout_s=timeout_s,
        drain_s=300,
    )


# systemctl: "active" state lives in $STATE/active; "failed" in $STATE/failed; "enabled" in
# $STATE/enabled; $STATE/loaded: systemd runs the unit file on disk (else it needs a daemon-reload).
SYSTEMCTL = """case "$1" in
  is-active) [ -e "$STATE/active" ] ;;
  is-failed) [ -e "$STATE/failed" ] ;;
  is-enabled) if [ -e "$STATE/enabled" ]; then echo enabled; else echo disabled; exit 1; fi ;;
  enable) touch "$STATE/enabled" ;;
  daemon-reload) touch "$STATE/loaded" ;;
  start|restart) touch "$STATE/active" ;;
  list-unit-files) [ -e "$STATE/installed" ] ;;
  disable) rm -f "$STATE/active" "$STATE/enabled" ;;
  show) if [ "$3" = LoadState ]; then
          echo LoadState=loaded
          if [ -e "$STATE/loaded" ]; then echo NeedDaemonReload=no; else echo NeedDaemonReload=yes; fi
          exit 0
        fi
        n=$(cat "$STATE/nrestarts" 2>/dev/null || echo 0); echo "$n"
        [ -e "$STATE/crashloop" ] && echo $((n + 1)) > "$STATE/nrestarts"; exit 0 ;;
  *) exit 0 ;;
esac"""


@pytest.fixture
def stubs(tmp_path):
    s = StubPath(tmp_path)
    s.add("systemctl", SYSTEMCTL)
    s.add("curl", '[ -e "$STATE/healthy" ]')
    s.add("journalctl", 'echo "vllm: CUDA error: out of memory"')
    s.add("sleep", "exit 0")
    return s


def test_shellcheck_clean(tmp_path):
    r = shellcheck(script(), tmp_path)
    assert r.returncode == 0, r.stdout


def test_first_apply_starts_and_waits_for_health(stubs):
    (stubs.state / "healthy").touch()
    r = stubs.run(script(), "apply")
    assert r.returncode == 0, r.stderr
    assert "systemctl daemon-reload" in r.calls
    assert "systemctl enable --quiet glm-vllm-prefill-0.service" in r.calls
    assert "systemctl start glm-vllm-prefill-0.service" in r.calls
    assert not r.called("systemctl restart")
    assert "b300-1: glm-vllm-prefill-0.service healthy" in r.stdout


def test_apply_reloads_systemd_and_enables_the_unit_only_when_needed(stubs):
    """A reload re-reads every unit and `systemctl enable` reloads too, each time: a unit systemd already runs
    from its file, enabled, gets neither; one whose file changed (NeedDaemonReload) gets the reload."""
    (stubs.state / "healthy").touch()
    assert stubs.run(script(), "apply").returncode == 0
    again = stubs.run(script(), "apply")
    assert again.returncode == 0, again.stderr
    assert "systemctl restart glm-vllm-prefill-0.service" in again.calls
    assert not again.called("systemctl daemon-reload") and not again.called("systemctl enable")
    (stubs.state / "loaded").unlink()  # the unit file's own step wrote a new one
    changed = stubs.run(script(), "apply")
    assert changed.returncode == 0, changed.stderr
    assert changed.calls.index("systemctl daemon-reload") < changed.calls.index("systemctl restart glm-vllm-prefill-0.service")
    assert not changed.called("systemctl enable")


def test_apply_reloads_systemd_when_it_cannot_tell_whether_it_must(stubs):
    """systemctl show failing, or answering nothing or something else than loaded/no, is no proof that systemd
    runs the unit file on disk: the apply reloads (the safe side) and still starts the unit."""
    (stubs.state / "healthy").touch()
    (stubs.state / "loaded").touch()
    (stubs.state / "enabled").touch()
    for answer in ("exit 1", "exit 0", "echo LoadState=not-found; echo NeedDaemonReload=no; exit 0"):
        stubs.add("systemctl", f'if [ "$1 $3" = "show LoadState" ]; then {answer}; fi\n' + SYSTEMCTL)
        (stubs.state / "active").unlink(missing_ok=True)  # stopped: each apply starts it
        r = stubs.run(script(), "apply")
        assert r.returncode == 0, (answer, r.stderr)
        assert r.calls.index("systemctl daemon-reload") < r.calls.index("systemctl start glm-vllm-prefill-0.service"), answer


def test_start_leaves_a_running_unit_alone(stubs):
    (stubs.state / "active").touch()
    (stubs.state / "healthy").touch()
    r = stubs.run(script(), "start")
    assert r.returncode == 0
    assert not r.called("systemctl restart") and not r.called("systemctl start")
    assert "healthy" in r.stdout


def test_apply_on_a_running_unit_restarts_it(stubs):
    (stubs.state / "active").touch()
    (stubs.state / "healthy").touch()
    r = stubs.run(script(), "apply")
    assert r.returncode == 0
    assert "systemctl restart glm-vllm-prefill-0.service" in r.calls


def test_unhealthy_unit_fails_with_host_and_journal(stubs):
    r = stubs.run(script(timeout_s=1), "apply", env={"GLM_TEST": "1"})
    assert r.returncode == 1
    assert "b300-1: glm-vllm-prefill-0.service is not healthy within 1s: it does not answer http://10.0.0.11:8100/health" in r.stderr
    assert "CUDA error: out of memory" in r.stderr  # the unit's last journal lines


def test_failed_unit_fails_fast(stubs):
    (stubs.state / "failed").touch()
    r = stubs.run(script(timeout_s=3600), "apply")
    assert r.returncode == 1
    assert "failed while starting" in r.stderr
    assert sum(c.startswith("curl") for c in r.calls) == 1


def test_crash_loop_behind_restart_on_failure_fails_fast(stubs):
    (stubs.state / "crashloop").touch()  # every look at NRestarts finds one more restart
    r = stubs.run(script(timeout_s=3600), "apply")
    assert r.returncode == 1
    assert "glm-vllm-prefill-0.service failed while starting" in r.stderr
    assert "CUDA error" in r.stderr


def test_check_and_remove(stubs):
    r = stubs.run(script(), "check")
    assert r.returncode == 1 and "is not active" in r.stderr
    (stubs.state / "active").touch()
    (stubs.state / "healthy").touch()
    assert stubs.run(script(), "check").returncode == 0
    (stubs.state / "installed").touch()
    r = stubs.run(script(), "remove")
    assert r.returncode == 0
    assert "systemctl disable --now --quiet glm-vllm-prefill-0.service" in r.calls


def test_unknown_action(stubs):
    assert stubs.run(script(), "bogus").returncode == 2


def test_remove_that_cannot_stop_the_unit_fails(stubs):
    """A vLLM left running after destroy holds its GPUs: say so instead of "stopped and disabled"."""
    (stubs.state / "installed").touch()
    stubs.add("systemctl", 'case "$1" in list-unit-files) exit 0 ;; disable) exit 1 ;; *) exit 0 ;; esac')
    r = stubs.run(script(), "remove")
    assert r.returncode == 1 and "b300-1: could not stop and disable glm-vllm-prefill-0.service" in r.stderr
    assert "stopped and disabled" not in r.stdout


def test_a_unit_that_answers_late_is_waited_for(stubs):
    stubs.add("curl", 'n=$(cat "$STATE/looks" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE/looks"; [ "$n" -ge 2 ]')
    r = stubs.run(script(timeout_s=3600), "apply")
    assert r.returncode == 0 and "glm-vllm-prefill-0.service healthy" in r.stdout, r.stderr
    assert sum(c.startswith("curl") for c in r.calls) == 3


def test_check_fails_for_an_active_unit_that_does_not_answer(stubs):
    (stubs.state / "active").touch()
    r = stubs.run(script(), "check")
    assert r.returncode == 1 and "glm-vllm-prefill-0.service does not answer http://10.0.0.11:8100/health" in r.stderr


def test_check_of_a_unit_that_answers_unhealthy_says_what_it_answered(stubs):
    """vllm-router answers /health with 503 and the workers it finds unhealthy: the check says so, not that
    the router does not answer (an operator would look for a dead router)."""
    (stubs.state / "active").touch()
    stubs.add("curl", """out=""; w=""
while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift ;; -w) w=$2; shift ;; esac; shift; done
[ -n "$w" ] || exit 22
printf 'unhealthy workers: http://127.0.0.1:9100 (prefill-0)\\n' > "$out"; printf 503""")
    r = stubs.run(script(), "check")
    assert r.returncode == 1
    assert ("glm-vllm-prefill-0.service answers http://10.0.0.11:8100/health with HTTP 503: unhealthy workers: "
            "http://127.0.0.1:9100 (prefill-0)") in r.stderr, r.stderr
