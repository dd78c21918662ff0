"""README.md and docs/*.md: every command the documents tell someone to type is one a test runs. Each
```sh block is preceded by ``<!-- tested: FILE::TEST, ... -->``, naming at least one file under tests/
(a script the tests run, such as scripts/demo, may be named beside them); the named tests must exist,
and each command's subcommand, long flags and glm-infra keys must appear in them.
A command no test runs goes in a plain ``` block (or in prose), never in a ```sh one."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "OPERATIONS.md"
# Every document a reader runs commands from; each must hold at least this many tested blocks.
DOCUMENTS = {"README.md": 5, **{f"docs/{p.name}": 0 for p in sorted((ROOT / "docs").glob("*.md"))},
             "docs/OPERATIONS.md": 10}
# Helpers the end-to-end tests run their commands through.
E2E_HELPERS = [ROOT / "tests/e2e/harness.py", ROOT / "tests/e2e/conftest.py"]
BLOCK = re.compile(r"(?:<!-- tested: (?P<refs>[^>]*) -->\n)?```sh\n(?P<body>.*?)```", re.S)
SEGMENT_SPLIT = re.compile(r"\$\(|\)|\|\||&&|\||;")


def blocks(text: str) -> list[tuple[list[str], list[str]]]:
    out = []
    for m in BLOCK.finditer(text):
        refs = [r.strip() for r in (m["refs"] or "").split(",") if r.strip()]
        lines = [re.sub(r"\s+#.*$", "", line).strip() for line in m["body"].splitlines()]
        out.append((refs, [line for line in lines if line]))
    return out


def corpus(refs: list[str]) -> str:
    """The source of the tests a block names (whole files, and the e2e helpers they call)."""
    texts = []
    for ref in refs:
        path, _, test = ref.partition("::")
        f = ROOT / path
        assert f.is_file(), f"{ref}: no such file"
        source = f.read_text()
        if test:
            names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
            assert test in names, f"{ref}: no test of that name in {path}"
        texts.append(source)
        if path.startswith("tests/e2e/"):
            texts += [h.read_text() for h in E2E_HELPERS]
    return "\n".join(texts)


def words_of(segment: str) -> list[str]:
    words = shlex.split(segment.replace("<", " < ").replace(">", " > "))
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value before the command
        words.pop(0)
    out, skip = [], False
    for w in words:  # drop redirections and their targets
        if skip:
            skip = False
        elif w in ("<", ">"):
            skip = True
        else:
            out.append(w)
    return out


def required(segment: str) -> list[tuple[str, ...]]:
    """What a test must contain for it to run this command: each entry is a set of alternatives."""
    words = words_of(segment)
    if not words:
        return []
    program, rest = words[0].removeprefix("venv/bin/"), words[1:]
    need: list[tuple[str, ...]] = []
    if program == "pulumi":
        sub = []
        for w in rest:
            if not re.fullmatch(r"[a-z]+", w):
                break
            sub.append(w)
        need.append((" ".join(["pulumi", *sub]),))
    elif program == "glm-infra":
        need.append((f'"{rest[0]}"', f"'{rest[0]}'", f"glm-infra {rest[0]}"))
    elif program == "check-jsonschema":
        need.append(("check-jsonschema", "check_jsonschema"))
    elif program.startswith("scripts/"):
        need.append((program, program.rsplit("/", 1)[1]))
        if rest and not rest[0].startswith("-"):
            need.append((f"{rest[0]})", f'"{rest[0]}"'))
    elif program == "export":
        need.append((rest[0].split("=", 1)[0],))
    elif program == "cp":
        return []
    elif program in ("curl", "sed", "journalctl", "grep"):  # the test must run the same tool (its long flags below)
        need.append((program,))
    else:
        raise AssertionError(f"the guide runs {program!r}: teach tests/test_guide.py what its tests must show")
    for w in rest:
        if w.startswith("--"):
            need.append((w.split("=", 1)[0],))
        for key in re.findall(r"glm-infra:([\w.\[\]]+)", w):
            need.append((re.sub(r"\[\d+\]", "", key).rsplit(".", 1)[-1],))
    return need


@pytest.mark.parametrize("document", sorted(DOCUMENTS))
def test_every_command_block_names_the_tests_that_run_it(document):
    found = blocks((ROOT / document).read_text())
    assert len(found) >= DOCUMENTS[document], f"{document}'s command blocks"
    for refs, lines in found:
        assert any(r.startswith("tests/") for r in refs), f"{document}: a command block names no test: {lines}"
        source = corpus(refs)
        for line in lines:
            for segment in SEGMENT_SPLIT.split(line):
                for alternatives in required(segment):
                    assert any(a in source for a in alternatives), (
                        f"{document}: `{line}`: none of {list(alternatives)} is in {', '.join(refs)}")


def test_the_guide_covers_what_an_operator_on_call_needs():
    text = GUIDE.read_text()
    for heading in ("Quick start", "A new topology is a new stack", "Reusing the components", "Roll a flag change",
                    "Add a decode or prefill host", "Rotate the API key", "Rotate the HF token", "Rotate the SSH key",
                    "Upgrade vLLM", "Upgrade the driver", "Move the state to a team backend", "SLA gate",
                    "Troubleshooting"):
        assert heading in text, heading
    # The troubleshooting table names every alert the rules define.
    rules = (ROOT / "glm_infra/roles/monitoring/templates/prometheus-rules.yml.j2").read_text()
    for alert in re.findall(r"alert: (Glm\w+?)(?:\{\{|\s)", rules):
        assert alert in text, f"{alert} is missing from the troubleshooting table"


@pytest.mark.parametrize("segment,need", [
    ("pulumi config set -s x --secret --path 'glm-infra:router.apiKey' < key.txt",
     [("pulumi config set",), ("--secret",), ("--path",), ("apiKey",)]),
    ("venv/bin/glm-infra sla prod-b300 --cacert ca.pem", [('"sla"', "'sla'", "glm-infra sla"), ("--cacert",)]),
    ("GLM_INFRA_API_KEY=x scripts/demo up", [("scripts/demo", "demo"), ("up)", '"up"')]),
    ("export PULUMI_BACKEND_URL='postgres://x'", [("PULUMI_BACKEND_URL",)]),
    ("curl -fsS --cacert ca.pem --config - https://x/v1", [("curl",), ("--cacert",), ("--config",)]),
    ("sed -e 's/^/header = /' -e 's/$/x/'", [("sed",)]),
])
def test_what_a_command_needs_its_test_to_show(segment, need):
    assert required(segment) == need


def test_every_document_is_held_to_the_rule():
    """A new page under docs/ is checked without being listed: the glob finds it."""
    assert {"README.md", "docs/OPERATIONS.md", "docs/DEPLOYING.md", "docs/STACK.md"} <= set(DOCUMENTS)
    assert len([d for d in DOCUMENTS if d.startswith("docs/")]) == len(list((ROOT / "docs").glob("*.md")))


def test_the_readme_path_is_the_one_the_tests_run():
    """The README's real-host path in its order: copy a stack, validate, plan, preview, up, a request with the CA."""
    commands = [line for _, lines in blocks((ROOT / "README.md").read_text()) for line in lines]
    order = ["cp stacks/", "glm-infra validate", "glm-infra plan", "pulumi preview", "pulumi up", "--cacert"]
    at = [next(i for i, c in enumerate(commands) if step in c) for step in order]
    assert at == sorted(at), commands
    assert "scripts/demo up" in commands and "scripts/demo down" in commands


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("document", sorted(DOCUMENTS))
def test_every_relative_link_reaches_a_file_and_heading(document):
    """The README and docs/ link each other by file and section; a moved or renamed one is caught."""
    source = ROOT / document
    for target, _, section in re.findall(r"\]\((?!https?://)([^)#\s]*)(#([^)\s]+))?\)", source.read_text()):
        path = (source.parent / target).resolve() if target else source
        assert path.exists(), f"{document}: {target} does not exist"
        if section and path.suffix == ".md":
            headings = {anchor(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
            assert section in headings, f"{document}: {target}#{section} is no heading of {path.name}"


def test_anchors_are_githubs():
    assert anchor("TLS at the router's front") == "tls-at-the-routers-front"
    assert anchor("Fleet no-op `up`") == "fleet-no-op-up"


def test_a_block_without_its_test_is_caught(tmp_path):
    text = "<!-- tested: tests/test_guide.py::no_such_test -->\n```sh\npulumi up -s x\n```\n```sh\npulumi up\n```\n"
    (refs, _), (bare, _) = blocks(text)
    with pytest.raises(AssertionError, match="no test of that name"):
        corpus(refs)
    assert bare == []
    with pytest.raises(AssertionError, match="teach tests/test_guide.py"):
        required("rm -rf /")


def test_the_deploying_alert_table_is_every_alert_with_its_severity():
    """docs/DEPLOYING.md's alert table mirrors the rules: each alert once, with the severity its rule pages with
    (a row may name several, `…Decode` standing for the alert before it with Decode in place of its last word)."""
    rules = (ROOT / "glm_infra/roles/monitoring/templates/prometheus-rules.yml.j2").read_text()
    want = {}
    for name, severity in re.findall(r"alert: (.+)\n(?:.*\n)*?\s+labels: \{severity: (\w+)\}", rules):
        for pool in ("prefill", "decode", "colocated") if "{{ pool" in name else ("",):
            want[re.sub(r"\{\{ pool \| capitalize \}\}", pool.capitalize(), name)] = severity
    text = (ROOT / "docs" / "DEPLOYING.md").read_text()
    table = text.split("| alert | fires when | severity |", 1)[1].split("\n\n", 1)[0]
    shown = {}
    for row in table.strip().splitlines()[1:]:
        names_cell, _, severity_cell = (c.strip() for c in row.strip("|").split("|"))
        names, last = [], ""
        for name in re.findall(r"`([^`]+)`", names_cell):
            name = re.sub(r"[A-Z][a-z]+$", name[1:], last) if name.startswith("…") else name
            names.append(name)
            last = name
        severities = [s.strip() for s in severity_cell.split(",")]
        severities = severities * len(names) if len(severities) == 1 else severities
        assert len(severities) == len(names), row
        for name, severity in zip(names, severities):
            assert name not in shown, f"{name} twice"
            shown[name] = severity
    assert shown == want


def test_the_commands_table_is_every_glm_infra_command():
    """OPERATIONS.md section 7 mirrors the command line: every subcommand of `glm-infra` is there with a command
    that runs it, and every command there is one the parser knows, with options it knows."""
    import argparse

    from glm_infra.tools.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    text = GUIDE.read_text()
    table = text.split("## 7. The glm-infra commands", 1)[1].split("\n## ", 1)[0]
    shown: dict[str, set[str]] = {}
    for cell in re.findall(r"`(?:[A-Z_]+=\S+ )*venv/bin/glm-infra ([^`]+)`", table):
        words = cell.split()
        shown.setdefault(words[0], set()).update(w.split("=")[0] for w in words[1:] if w.startswith("--"))
    assert set(shown) == set(sub), "the table's commands against the parser's"
    for name, options in shown.items():
        known = {o for a in sub[name]._actions for o in a.option_strings}
        for child in (a for a in sub[name]._actions if isinstance(a, argparse._SubParsersAction)):
            known |= {o for p in child.choices.values() for a in p._actions for o in a.option_strings}
        assert options <= known, f"glm-infra {name}: {sorted(options - known)} unknown"
