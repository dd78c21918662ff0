"""Each host program's usage in its docstring (what ``--help`` prints and an operator reads on a host) says what
its parser does: an option shown outside brackets is required, one inside is optional, and none is missing
or invented. (hostcheck.py preflight once showed --min-kernel as optional while the parser required it.)"""

from __future__ import annotations

import argparse
import re

import pytest

from glm_infra.agent import canary, hostcheck


def usages(doc: str, prog: str, sub: str) -> list[str]:
    """Each usage form of ``prog sub``: its line and the more indented ones that continue it (up to the
    explanation that follows on the right)."""
    lines = doc.splitlines()
    forms = []
    for i, line in enumerate(lines):
        if not re.match(rf"\s+{re.escape(prog)} {sub}\b", line):
            continue
        indent = len(line) - len(line.lstrip())
        form = [line]
        for more in lines[i + 1:]:
            if not more.strip() or len(more) - len(more.lstrip()) <= indent or not more.strip().startswith(("[", "--")):
                break
            form.append(more)
        forms.append(" ".join(f.strip().split("  ")[0] for f in form))
    return forms


def claims(text: str) -> tuple[set[str], set[str]]:
    """(options shown outside brackets, options shown inside)."""
    required, optional, depth = set(), set(), 0
    for token in re.findall(r"\[|\]|--[a-z][\w-]*", text):
        if token == "[":
            depth += 1
        elif token == "]":
            depth -= 1
        else:
            (optional if depth else required).add(token)
    return required, optional


def subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices


CASES = [(hostcheck, "hostcheck.py", sub) for sub in subparsers(hostcheck.parser())] + \
        [(canary, "canary.py", sub) for sub in subparsers(canary.parser())]


@pytest.mark.parametrize(("module", "prog", "sub"), CASES, ids=[f"{p} {s}" for _, p, s in CASES])
def test_the_usage_says_which_options_are_required(module, prog, sub):
    parser = subparsers(module.parser())[sub]
    options = {o: a.required for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    parsed_required = {o for o, req in options.items() if req}
    forms = [claims(f) for f in usages(module.__doc__, prog, sub)]
    assert forms, f"no usage of {prog} {sub}"
    shown = set().union(*(r | o for r, o in forms))
    assert shown <= set(options), "shown but not parsed"
    assert set(options) <= shown, "parsed but never shown"
    for shown_required, shown_optional in forms:
        assert parsed_required <= shown_required, "a required option shown optional or not at all"
        if len(forms) == 1:  # alternatives (two forms) need more than one parser can say: main() checks them
            assert shown_required == parsed_required, "shown required, parsed optional"
