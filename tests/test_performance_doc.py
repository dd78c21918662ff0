"""Every figure of docs/PERFORMANCE.md says when it was measured, and goes stale visibly: each section names the
commit and date it was measured at and the code it measures; a test fails once that code has changed in more
than STALE_AFTER commits since, until the figure is measured again (a new commit in its line) or the section
says it is stale, in bold, where a reader sees it. A section labelled stale that is not is refused too."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import ROOT

STALE_AFTER = 40  # commits that changed the measured code
PAGE = ROOT / "docs" / "PERFORMANCE.md"
MARK = re.compile(r"^(?P<stale>\*\*Stale:\*\* measured|Measured) at `(?P<commit>[0-9a-f]{7,40})` \((?P<date>\d{4}-\d\d-\d\d)\) "
                  r"on the code of (?P<code>(?:`[^`]+`(?:, )?)+)(?P<rest>.*)$", re.M)


def sections() -> dict[str, str]:
    parts = re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]
    return {part.splitlines()[0]: part for part in parts}


def git(*args: str) -> str:
    p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    assert p.returncode == 0, f"git {' '.join(args)}: {p.stderr}"
    return p.stdout.strip()


def problem(title: str, text: str) -> str | None:
    """Why a section's measurement line fails the rule, or None."""
    marks = list(MARK.finditer(text))
    if len(marks) != 1:
        return f"## {title}: one 'Measured at `COMMIT` (DATE) on the code of `PATH`' line"
    m = marks[0]
    commit, code = m["commit"], re.findall(r"`([^`]+)`", m["code"])
    if git("log", "-1", "--format=%ad", "--date=short", f"{commit}^{{commit}}") != m["date"]:
        return f"## {title}: {commit} is not of {m['date']}"
    if not all((ROOT / path).exists() for path in code):
        return f"## {title}: {code} names a path that does not exist"
    since = int(git("rev-list", "--count", f"{commit}..HEAD", "--", *code))
    if m["stale"].startswith("**Stale"):
        if since <= STALE_AFTER or f"more than {STALE_AFTER} commits since" not in m["rest"]:
            return f"## {title}: labelled stale, but its code changed in {since} commits since"
    elif since > STALE_AFTER:
        return (f"## {title}: measured at {commit}, {since} commits of {', '.join(code)} ago (more than "
                f"{STALE_AFTER}): measure it again, or label it stale")
    return None


@pytest.mark.parametrize("title", list(sections()))
def test_each_section_says_when_it_was_measured_and_is_fresh_or_says_it_is_stale(title):
    assert problem(title, sections()[title]) is None


def test_the_rule_catches_a_figure_older_than_its_code_a_wrong_date_and_a_false_label():
    first = git("rev-list", "--max-parents=0", "HEAD").splitlines()[-1]
    day = git("log", "-1", "--format=%ad", "--date=short", first)
    head = git("rev-parse", "--short", "HEAD")
    today = git("log", "-1", "--format=%ad", "--date=short", "HEAD")
    old = f"Measured at `{first[:7]}` ({day}) on the code of `glm_infra/`."
    assert "measure it again, or label it stale" in problem("old", old)
    assert problem("old", old.replace("Measured", "**Stale:** measured").replace(
        "`glm_infra/`.", f"`glm_infra/`, which has changed in more than {STALE_AFTER} commits since.")) is None
    assert problem("new", f"Measured at `{head}` ({today}) on the code of `glm_infra/`.") is None
    assert "is not of" in problem("new", f"Measured at `{head}` (1999-01-01) on the code of `glm_infra/`.")
    assert "labelled stale, but" in problem("new", f"**Stale:** measured at `{head}` ({today}) on the code of "
                                                   f"`glm_infra/`, which has changed in more than {STALE_AFTER} commits since.")
    assert "one 'Measured at" in problem("none", "| a figure | 1.0 s |")
