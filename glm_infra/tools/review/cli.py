"""``glm-infra diff`` and ``scripts/pr-review`` (validate, review, preview, and the markdown for the pull
request)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .preview import TITLE, PreviewSummary, summarize_preview
from .rendering import InvalidStack, ReviewError
from .report import COMMENT_LIMIT, format_markdown, format_text, headline
from .revision import diff, stacks_in

# --- glm-infra diff ------------------------------------------------------------------------------

def project_dir() -> Path:
    """The project around the current directory (nearest Pulumi.yaml), else this source tree."""
    cwd = Path.cwd()
    for d in (cwd, *cwd.parents):
        if (d / "Pulumi.yaml").is_file() and (d / "stacks").is_dir():
            return d
    return Path(__file__).resolve().parents[3]


def add_parser(sub) -> None:
    d = sub.add_parser("diff", help="what a change deploys: stacks rendered at a git revision and now, compared")
    d.add_argument("stacks", nargs="*", metavar="STACK", help="stack names (prod-b300)")
    d.add_argument("--all", action="store_true", help="every stack in stacks/, at the revision or now")
    d.add_argument("--against", required=True, metavar="REF", help="git revision to compare with (main, origin/main, a commit)")
    d.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    d.add_argument("--no-diff", action="store_true", help="text: leave the files' diffs out")


def run_diff(args: argparse.Namespace) -> int:
    if bool(args.stacks) == bool(args.all):
        print("glm-infra diff: give STACK names or --all", file=sys.stderr)
        return 2
    try:
        review = diff(project_dir(), args.against, None if args.all else args.stacks)
    except InvalidStack as e:
        print(e, file=sys.stderr)
        return 1
    except ReviewError as e:
        print(f"glm-infra diff: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(review.to_json(), indent=2))
    elif args.format == "markdown":
        print(format_markdown(review))
    else:
        print(format_text(review, diffs=not args.no_diff), end="")
    return 0


# --- scripts/pr-review ---------------------------------------------------------------------------

def preview(stack: str, repo: Path) -> dict | str:
    """``pulumi preview -s STACK --json``'s JSON, or why there is none."""
    try:
        p = subprocess.run(["pulumi", "preview", "-s", stack, "--json", "--non-interactive", "--suppress-progress"],
                           cwd=repo, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        return "not run: no pulumi on PATH"
    except subprocess.TimeoutExpired:
        return "failed: pulumi preview ran over 30 min"
    if p.returncode != 0 and f"no stack named '{stack}'" in p.stderr:
        return f"not run: the backend has no stack {stack} yet (`pulumi stack init {stack}` once, by whoever deploys)"
    try:
        data = json.loads(p.stdout)
    except ValueError:
        return f"failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}"
    if p.returncode != 0 and not data.get("diagnostics"):
        data["diagnostics"] = [{"severity": "error", "message": (p.stderr or "").strip()[-1500:] or f"exit {p.returncode}"}]
    return data


def ssh_key_paths(repo: Path) -> list[str]:
    """The SSH key files the stacks in ``repo``'s stacks/ name (``ssh.privateKeyPath``, expanded):
    the program reads the key when it runs, a preview too."""
    from glm_infra.stack import StackError, load_file

    out = set()
    for name in stacks_in(repo):
        try:
            path = load_file(repo / "stacks" / f"Pulumi.{name}.yaml").config.ssh.private_key_path
        except StackError:
            continue  # validate reports it
        if path:
            out.add(os.path.expanduser(path))
    return sorted(out)


def pr_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/pr-review", description=(
        "validate every stack, diff the rendering of every stack against the base revision, pulumi preview "
        "the stacks whose rendering changed; one markdown summary to $GITHUB_STEP_SUMMARY (else stdout)"))
    ap.add_argument("--base", metavar="REF", help="the revision the change goes onto (a branch, tag or commit)")
    ap.add_argument("--stack", action="append", metavar="STACK", help="only these stacks (default: every stack)")
    ap.add_argument("--no-preview", action="store_true", default=os.environ.get("GLM_INFRA_REVIEW_NO_PREVIEW") == "1",
                    help="engine-free: no pulumi preview (also GLM_INFRA_REVIEW_NO_PREVIEW=1)")
    ap.add_argument("--summary", metavar="FILE", default=os.environ.get("GITHUB_STEP_SUMMARY") or None,
                    help="append the markdown here (default $GITHUB_STEP_SUMMARY, else stdout)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the markdown here (for a PR comment)")
    ap.add_argument("--json", metavar="FILE", help="also write the whole review and the previews as JSON")
    ap.add_argument("--ssh-key-paths", action="store_true",
                    help="only print the SSH key files the stacks name (ssh.privateKeyPath), one a line")
    args = ap.parse_args(argv)
    repo = project_dir()
    if args.ssh_key_paths:
        print("\n".join(ssh_key_paths(repo)))
        return 0
    if not args.base:
        ap.error("--base REF is needed")
    outputs = [args.summary, args.markdown]
    names = stacks_in(repo)
    v = subprocess.run([sys.executable, "-m", "glm_infra.tools.cli", "validate", *names], cwd=repo, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    sys.stderr.write(v.stdout + v.stderr)
    if v.returncode != 0:
        _emit(f"{TITLE}\n\n`glm-infra validate` refused a stack:\n\n```\n{v.stderr.strip()}\n```\n", *outputs)
        return 1
    try:
        review = diff(repo, args.base, args.stack)
    except (InvalidStack, ReviewError) as e:
        _emit(f"{TITLE}\n\nThe review could not run:\n\n```\n{e}\n```\n", *outputs)
        print(e, file=sys.stderr)
        return 1
    status = 0
    previews: dict[str, PreviewSummary | str] = {}
    touched = [s.stack for s in review.stacks if s.status in ("changed", "added")]
    if args.no_preview:
        previews = {s: "not run (--no-preview)" for s in touched}
    elif not os.environ.get("PULUMI_BACKEND_URL") and not os.environ.get("PULUMI_ACCESS_TOKEN"):
        previews = {s: "not run: no state backend configured (PULUMI_BACKEND_URL)" for s in touched}
    else:
        for s in touched:
            data = preview(s, repo)
            result = summarize_preview(s, data, review.new.get(s)) if isinstance(data, dict) else data
            previews[s] = result
            if (isinstance(result, str) and not result.startswith("not run")) or (
                    isinstance(result, PreviewSummary) and result.errors):
                status = 1
    lead = [f"`glm-infra validate`: {len(names)} stacks valid.", ""]
    _emit(format_markdown(review, previews, lead=lead), *outputs,
          comment=format_markdown(review, previews, COMMENT_LIMIT, lead=lead))
    if args.json:
        Path(args.json).write_text(json.dumps({"review": review.to_json(), "previews": {
            k: (asdict(v) if isinstance(v, PreviewSummary) else v) for k, v in previews.items()}}, indent=2))
    print(f"glm-infra pr-review: {headline(review)}", file=sys.stderr)
    return status


def _emit(markdown: str, summary: str | None, markdown_file: str | None = None, comment: str | None = None) -> None:
    """The summary to ``summary`` (appended) or stdout, and to ``markdown_file`` (``comment`` if given:
    the shorter text for a pull-request comment)."""
    if summary:
        with open(summary, "a") as f:
            f.write(markdown + "\n")
    else:
        print(markdown)
    if markdown_file:
        Path(markdown_file).write_text((comment if comment is not None else markdown) + "\n")
