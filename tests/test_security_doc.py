"""docs/SECURITY.md: its port table is what the port plan gives (every listener of prod-b300, who may connect
and what it must carry), its threat model is kept, and a listener nobody wrote a credential for is named. That
every port a converged simulated host listens on appears in it is tests/e2e/test_operations.py's."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT

from glm_infra.plan import ports
from glm_infra.stack import load_file
from glm_infra.tools import security_doc


def test_the_page_is_what_the_plan_gives():
    p = subprocess.run([sys.executable, str(ROOT / "scripts/gen-security-doc"), "--check"], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr


def documented(text: str) -> dict[tuple[str, int], str]:
    """(host, port) → what listens, from the page's table."""
    return {(m[1], int(m[2])): m[3] for m in re.finditer(r"^\| (\S+) \| (\d+) \| ([^|]+?) \|", text, re.M)}


def test_every_listener_of_the_plan_and_sshd_has_a_row_with_who_and_what():
    cfg = load_file(ROOT / security_doc.STACK).config
    rows = documented((ROOT / security_doc.DOC_FILE).read_text())
    want = {(li.host, li.port): li.owner for li in ports.listeners(cfg)}
    want.update({(h.name, h.ssh_port): "sshd (the distribution's; glm-infra connects with it)" for h in cfg.hosts})
    assert rows == want
    for li in ports.listeners(cfg):
        assert security_doc.credential(li.owner), li


def test_the_threat_model_is_kept_and_the_table_rewritten(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "stacks").mkdir()
    (tmp_path / security_doc.STACK).write_text((ROOT / security_doc.STACK).read_text())
    page = security_doc.page("# Security\n\nhand-written\n\n", tmp_path)
    assert page.startswith("# Security\n\nhand-written\n\n" + security_doc.MARKER + "\n")
    assert security_doc.header_of(page + "| stale | 1 |\n") == "# Security\n\nhand-written\n\n"
    assert "| b300-3 | 8000 | router http | `router.port` | the stack's hosts and `router.allowedCidrs` |" in page


def test_a_listener_without_a_credential_written_is_named():
    with pytest.raises(KeyError, match="no credential written for 'a new listener'"):
        security_doc.credential("a new listener")
    assert security_doc.credential("router gate of decode-0").startswith("none: nginx in front of one instance")
    assert security_doc.credential("prefill-0 http").startswith("`/v1/*`: the workers' key")
    assert security_doc.credential("router http").startswith("TLS, then the client API key")
    assert security_doc.credential("decode warm-cache relay").startswith("the stack's relay key")
