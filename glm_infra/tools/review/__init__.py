"""Pull-request review: what a change deploys, stack by stack, without the engine (``glm-infra diff``),
and what ``pulumi preview`` says of it (``scripts/pr-review``).

A stack is rendered twice, each time by its own code: at a git revision (the revision's
``glm_infra`` and ``stacks/``, extracted with ``git archive``) and at the working tree. Each
rendering is the review tree of ``glm-infra render`` (what deploys is exactly that) plus who runs
where (hosts, instances and their pools, the router). ``compare`` turns two renderings into a
``StackChange``: the hosts and pools touched, the files that change (with a unified diff), the steps
that re-run, and the services that restart. A restart is read off the steps themselves
(``restarted_units``): a step that re-runs and runs a unit's service script (``unit=…``: the vLLM
instances' and the router's) with ``apply``, or with ``rollout ARG`` and an ARG (its triggers) it did
not run with before; or a packaged service's script (``services=(…)``) with ``apply`` and a new
``config_digest``. Nothing here lists the services by hand.

``summarize_preview`` reads the JSON of ``pulumi preview --json``: its steps, its own
``changeSummary``, and which updates are service restarts (by the same script test, on the
resource's new ``update``/``create`` command).

The package: ``rendering`` (one rendering, parsed; what restarts), ``compare`` (two renderings),
``revision`` (rendering a git revision by its own code), ``preview`` (``pulumi preview --json``),
``report`` (text and markdown), ``cli`` (``glm-infra diff``, ``scripts/pr-review``).
"""

from .cli import add_parser, pr_main, preview, project_dir, run_diff, ssh_key_paths
from .compare import FileChange, Restart, StackChange, StepChange, compare, file_kind, unified
from .preview import OPS, TITLE, PreviewSummary, summarize_preview
from .rendering import (
    MAX_DIFF_LINES,
    STACK_FILE,
    STEPS_DIR,
    Instance,
    InvalidStack,
    Rendering,
    ReviewError,
    StepText,
    expand,
    parse_step,
    restarted_units,
)
from .report import COMMENT_LIMIT, format_markdown, format_text, headline, restart_text
from .revision import Review, diff, extract, read_rendering, render_tree, resolve_ref, stacks_at_ref, stacks_in

__all__ = ["COMMENT_LIMIT", "FileChange", "Instance", "InvalidStack", "MAX_DIFF_LINES", "OPS", "PreviewSummary", "Rendering", "Restart", "Review", "ReviewError", "STACK_FILE", "STEPS_DIR", "StackChange", "StepChange", "StepText", "TITLE", "add_parser", "compare", "diff", "expand", "extract", "file_kind", "format_markdown", "format_text", "headline", "parse_step", "pr_main", "preview", "project_dir", "read_rendering", "render_tree", "resolve_ref", "restart_text", "restarted_units", "run_diff", "ssh_key_paths", "stacks_at_ref", "stacks_in", "summarize_preview", "unified"]
