"""Turn a ``Step`` into a ``command:remote:Command`` — the one place components touch the provider."""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_command.remote as remote

from ..steps import Step, digest


def inherited(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """The component's own ``depends_on``: children must carry it themselves, the engine only orders
    resources by the dependencies each registration names."""
    deps = (opts.depends_on if opts else None) or []
    return list(deps) if isinstance(deps, (list, tuple)) else [deps]


def with_triggers(command: str, triggers: Sequence[pulumi.Input[str]]) -> pulumi.Input[str]:
    """``command`` prefixed by a digest of the trigger values, so a changed value changes the command.

    pulumi-command replaces a resource whose ``triggers`` change (create the new, then run the old
    one's delete — which would undo the new). A changed command is an in-place update instead.
    The digest reveals nothing of a secret it was computed from, so it is not kept secret."""
    if not triggers:
        return command
    joined = pulumi.Output.all(*triggers).apply(lambda vs: f": glm-infra-triggers={digest(*(str(v) for v in vs))}; {command}")
    return pulumi.Output.unsecret(joined)


def run_step(
    name: str,
    step: Step,
    connection: remote.ConnectionArgs,
    parent: pulumi.Resource,
    *,
    stdin: pulumi.Input[str] | None = None,
    triggers: Sequence[pulumi.Input[str]] = (),
    depends_on: Sequence[pulumi.Resource] = (),
    timeout: str | None = None,
    retain_on_delete: bool = False,
) -> remote.Command:
    """``stdin`` overrides ``step.stdin`` (for content that is an Output, such as secret files)."""
    data = stdin if stdin is not None else step.stdin
    if step.secret and data is not None:
        data = pulumi.Output.secret(data)
    all_triggers = [*step.triggers, *triggers]
    command = with_triggers(step.create, all_triggers)
    return remote.Command(
        name,
        connection=connection,
        create=command,
        update=with_triggers(step.update, all_triggers) if step.update else command,
        delete=step.delete,
        stdin=data,
        add_previous_output_in_env=False,
        logging=remote.Logging.NONE if step.secret else remote.Logging.STDOUT_AND_STDERR,
        opts=pulumi.ResourceOptions(
            parent=parent,
            depends_on=list(depends_on),
            additional_secret_outputs=["stdin"] if step.secret else None,
            custom_timeouts=pulumi.CustomTimeouts(create=timeout, update=timeout) if timeout else None,
            retain_on_delete=retain_on_delete or None,
        ),
    )
