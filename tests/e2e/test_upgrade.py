"""A stack deployed by the previous main, then `pulumi up` with this checkout's code: the change a user
makes when they update glm-infra under a running cluster. Moving code (issue 28: modules into layer
packages) must not change a resource's URN or type, so the upgrade replaces and deletes nothing.

PREVIOUS is the last main before the layer packages; bump it when a change is meant to replace or
delete something on upgrade (and say so in the change)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from e2e.harness import ROOT, sh

PREVIOUS = "c29322fe210acf4e8b305e11b99439f0ab50311e"
# What an upgrade must not do to a resource of a running cluster.
DESTRUCTIVE = {"replace", "create-replacement", "delete-replaced", "delete", "discard", "create"}


def previous_tree(into: Path, mark: Path) -> Path:
    """PREVIOUS's program (git archive: what a user's checkout of it holds) with this checkout's venv (its
    pins are PREVIOUS's too), its glm_infra recording where it was imported from."""
    p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{PREVIOUS}^{{commit}}"],
                       capture_output=True, text=True)
    assert p.returncode == 0, f"{PREVIOUS} is not in this clone's history (a shallow clone?): {p.stderr}"
    into.mkdir()
    subprocess.run(f"git -C {ROOT} archive {PREVIOUS} | tar -x -C {into}", shell=True, check=True)
    (into / "venv").symlink_to(ROOT / "venv")
    init = into / "glm_infra" / "__init__.py"
    init.write_text(init.read_text() + "\nimport os as _os\nif _os.environ.get('GLM_UPGRADE_MARK'):\n"
                    "    open(_os.environ['GLM_UPGRADE_MARK'], 'w').write(__file__)\n")
    return into


def test_a_stack_deployed_by_the_previous_main_upgrades_without_replacing_or_deleting(stack, tmp_path):
    mark = tmp_path / "imported-from"
    previous = previous_tree(tmp_path / "previous", mark)
    sh(f"cd {previous} && pulumi up -s sim --yes --skip-preview --non-interactive",
       env={"GLM_UPGRADE_MARK": str(mark)})
    assert Path(mark.read_text()).parent == previous / "glm_infra", "the first up ran the previous main's code"
    deployed = [r for r in json.loads(sh("pulumi stack export -s sim").stdout)["deployment"]["resources"]
                if not r["type"].startswith("pulumi:providers:")]  # the summary does not count providers

    preview = stack.preview_json()  # this checkout's code, from the repository root
    bad = sorted(f"{s['op']} {s['urn']}" for s in preview["steps"] if s["op"] in DESTRUCTIVE)
    assert not bad, "the upgrade would replace, delete or add:\n" + "\n".join(bad)
    # The JSON lists the steps that change something; the summary counts every resource.
    summary = preview["changeSummary"]
    assert not DESTRUCTIVE & set(summary) and summary.get("same", 0) + summary.get("update", 0) == len(deployed), summary
    assert summary["same"] > 100, summary

    out = stack.up()
    summary = out.stdout[out.stdout.rfind("Resources:"):]
    assert not re.search(r"[1-9]\d* (to )?(replace|delete|create)", summary), summary
    after = [r for r in json.loads(sh("pulumi stack export -s sim").stdout)["deployment"]["resources"]
             if not r["type"].startswith("pulumi:providers:")]
    assert sorted(r["urn"] for r in after) == sorted(r["urn"] for r in deployed), "every URN as the previous main left it"
    sh("pulumi preview -s sim --expect-no-changes --non-interactive")
