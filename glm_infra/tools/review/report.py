"""The review as text (``glm-infra diff``) and as markdown (a pull-request comment, with the previews)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from .compare import Restart
from .preview import OPS, TITLE, PreviewSummary
from .rendering import MAX_DIFF_LINES
from .revision import Review

# --- output --------------------------------------------------------------------------------------

def _who(instance: str | None, pool: str | None) -> str:
    if instance == "router":
        return "the router"
    return f"{instance} of pool {pool}" if instance else ""


def headline(review: Review) -> str:
    by: dict[str, list[str]] = {}
    for s in review.stacks:
        by.setdefault(s.status, []).append(s.stack)
    parts = [f"{len(v)} {k} ({', '.join(v)})" for k, v in sorted(by.items(), key=lambda kv: _STATUS.index(kv[0]))]
    lead = f"against {review.against} ({review.commit[:12]}): "
    if not by.get("changed") and not by.get("added") and not by.get("removed"):
        return lead + "no rendered change: " + "; ".join(parts)
    return lead + "; ".join(parts)


_STATUS = ("changed", "added", "removed", "unchanged")


def restart_text(r: Restart) -> str:
    who = _who(r.instance, r.pool)
    return f"{r.host}: {r.unit}" + (f" ({who})" if who else "") + f" by step {r.step}"


def format_text(review: Review, diffs: bool = True) -> str:
    out = [f"glm-infra diff {headline(review)}"]
    for s in review.stacks:
        out.append("")
        out.append(f"{s.stack}: {s.status}")
        if s.status in ("added", "removed"):
            out.append(f"  hosts: {', '.join(s.hosts)}; pools: {', '.join(s.pools) or '-'}")
            continue
        if s.status == "unchanged":
            continue
        out.append(f"  hosts: {', '.join(s.hosts)}")
        if s.hosts_added or s.hosts_removed:
            out.append(f"  hosts added: {', '.join(s.hosts_added) or '-'}; removed: {', '.join(s.hosts_removed) or '-'}")
        out.append(f"  pools: {', '.join(s.pools) or '-'}" + (f" (instances {', '.join(s.instances)})" if s.instances else ""))
        out.append(f"  services that restart: {len(s.restarts)}")
        out += [f"    {restart_text(r)}" for r in s.restarts]
        out.append(f"  steps that re-run, added or removed: {len(s.steps)}")
        out += [f"    {c.host} {c.step}: {c.change}" + (f" ({', '.join(c.why)} changed)" if c.why else "")
                for c in s.steps]
        out.append(f"  files: {len(s.files)}")
        for f in s.files:
            out.append(f"    {f.host}:{f.path} ({f.kind}, {f.change})")
            if diffs:
                out += [f"      {line}" for line in _clip(f.diff)]
    for note in review.notes:
        out += ["", f"note: {note}"]
    return "\n".join(out) + "\n"


def _clip(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_DIFF_LINES:
        return lines
    return lines[:MAX_DIFF_LINES] + [f"… {len(lines) - MAX_DIFF_LINES} more lines (glm-infra diff --format json has all)"]


def _code(items: Iterable[str]) -> str:
    return ", ".join(f"`{x}`" for x in items) or "-"


COMMENT_LIMIT = 60000  # characters: a pull-request comment takes 65536


def format_markdown(review: Review, previews: Mapping[str, PreviewSummary | str] | None = None,
                    limit: int | None = None, diffs: bool = True, lead: Sequence[str] = ()) -> str:
    """The summary in markdown (``lead``: lines under the title); past ``limit`` characters without
    the files' diffs, then cut."""
    text = _markdown(review, previews or {}, diffs, lead)
    if limit is None or len(text) <= limit:
        return text
    if diffs:
        return format_markdown(review, previews, limit, False, lead)
    return text[:limit] + "\n\n… cut here: the job summary has the rest\n"


def _markdown(review: Review, previews: Mapping[str, PreviewSummary | str], diffs: bool, lead: Sequence[str]) -> str:
    out = [TITLE, "", *lead, headline(review).replace("against ", "Against ", 1), ""]
    changed = [s for s in review.stacks if s.status != "unchanged"]
    if changed:
        cols = ["stack", "status", "hosts", "pools", "files", "steps", "restarts"]
        if previews:
            cols.append("pulumi preview")
        out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        for s in changed:
            kinds: dict[str, int] = {}
            for f in s.files:
                kinds[f.kind] = kinds.get(f.kind, 0) + 1
            row = [f"`{s.stack}`", s.status, _code(s.hosts), _code(s.pools),
                   ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "-", str(len(s.steps)),
                   _code(f"{r.unit}@{r.host}" for r in s.restarts)]
            if previews:
                row.append(_preview_cell(previews.get(s.stack)))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    for s in changed:
        out.append(f"### `{s.stack}`: {s.status}")
        out.append("")
        if s.status in ("added", "removed"):
            out += [f"- hosts: {_code(s.hosts)}", f"- pools: {_code(s.pools)}", ""]
        else:
            out.append(f"- hosts: {_code(s.hosts)}" + (f" (added {_code(s.hosts_added)})" if s.hosts_added else "")
                       + (f" (removed {_code(s.hosts_removed)})" if s.hosts_removed else ""))
            out.append(f"- pools: {_code(s.pools)}" + (f", instances {_code(s.instances)}" if s.instances else ""))
            out.append("- services that restart: " + ("; ".join(restart_text(r) for r in s.restarts) or "none"))
            out.append("- files: " + ("; ".join(f"`{f.host}:{f.path}` ({f.kind}, {f.change})" for f in s.files) or "none"))
            out.append("- steps: " + ("; ".join(f"{c.host} `{c.step}` ({c.change}"
                                                          + (f": {', '.join(c.why)}" if c.why else "") + ")"
                                                          for c in s.steps) or "none"))
        p = previews.get(s.stack)
        if isinstance(p, PreviewSummary):
            out += _preview_lines(p)
        elif isinstance(p, str):
            out.append(f"- pulumi preview: {p}")
        if not diffs and any(f.diff for f in s.files):
            out += ["", "(the files' diffs are in the job summary: too long for a comment)"]
        elif any(f.diff for f in s.files):
            out += ["", "<details><summary>diff of the rendered files</summary>", "", "```diff"]
            for f in s.files:
                out += _clip(f.diff)
            out += ["```", "", "</details>"]
        out.append("")
    for note in review.notes:
        out += [f"> note: {note.splitlines()[0]}", ""]
    return "\n".join(out)


def _preview_cell(p: PreviewSummary | str | None) -> str:
    if p is None:
        return "-"
    if isinstance(p, str):
        return p
    return ", ".join(f"{p.counts[k]} {k}" for k in OPS) + (f", {len(p.errors)} errors" if p.errors else "")


def _preview_lines(p: PreviewSummary) -> list[str]:
    out = ["- pulumi preview: " + _preview_cell(p) + (f" (its own summary: {json.dumps(p.change_summary)})")]
    for op in OPS:
        if p.resources[op]:
            out.append(f"  - {op}: {_code(p.resources[op])}")
    out.append("  - service restarts: " + (_code(p.restarts) if p.restarts else "none"))
    out += [f"  - error: {e}" for e in p.errors]
    return out
