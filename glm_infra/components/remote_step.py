"""Turn a ``Step`` into a ``command:remote:Command`` (or ``command:local:Command``) — the one place
components touch the provider."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pulumi
import pulumi_command.local as local
import pulumi_command.remote as remote

from ..steps import TRIGGERS_TOKEN, Step, digest


def inherited(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """The component's own ``depends_on``: children must carry it themselves, the engine only orders
    resources by the dependencies each registration names."""
    deps = (opts.depends_on if opts else None) or []
    return list(deps) if isinstance(deps, (list, tuple)) else [deps]


def with_triggers(command: pulumi.Input[str], triggers: Sequence[pulumi.Input[str]]) -> pulumi.Input[str]:
    """``command`` prefixed by a digest of the trigger values, so a changed value changes the command.

    pulumi-command replaces a resource whose ``triggers`` change (create the new, then run the old
    one's delete — which would undo the new). A changed command is an in-place update instead.
    The digest reveals nothing of a secret it was computed from, so it is not kept secret."""
    if not triggers:
        return command
    joined = pulumi.Output.all(command, *triggers).apply(
        lambda vs: _stamp(vs[0], digest(*(str(v) for v in vs[1:]))))
    return pulumi.Output.unsecret(joined)


def _stamp(command: str, triggers_digest: str) -> str:
    return f": glm-infra-triggers={triggers_digest}; {command.replace(TRIGGERS_TOKEN, triggers_digest)}"


def run_step(
    name: str,
    step: Step,
    connection: remote.ConnectionArgs | None,
    parent: pulumi.Resource,
    *,
    live: pulumi.Output[Step] | None = None,
    stdin: pulumi.Input[str] | None = None,
    triggers: Sequence[pulumi.Input[str]] = (),
    depends_on: Sequence[pulumi.Resource] = (),
    environment: Mapping[str, pulumi.Input[str]] | None = None,
) -> remote.Command | local.Command:
    """Register ``step``. Its options (timeout, retention, logging, local or remote) are fixed when the
    program runs; its commands and stdin come from ``live`` when they depend on values another
    resource produces (addresses), else from ``step``. ``stdin`` overrides both (secret files)."""

    def field(attr: str) -> pulumi.Input:
        return live.apply(lambda s: getattr(s, attr)) if live is not None else getattr(step, attr)

    data = stdin if stdin is not None else (field("stdin") if step.stdin is not None else None)
    if step.secret and data is not None:
        data = pulumi.Output.secret(data)
    all_triggers: list[pulumi.Input[str]] = [
        *(live.apply(lambda s: digest(*s.triggers)) if live is not None else digest(*step.triggers),)
    ] if step.triggers else []
    all_triggers += list(triggers)
    create = with_triggers(field("create"), all_triggers)
    update = with_triggers(field("update"), all_triggers) if step.update is not None else create
    opts = pulumi.ResourceOptions(
        parent=parent,
        depends_on=list(depends_on),
        additional_secret_outputs=["stdin"] if step.secret else None,
        custom_timeouts=pulumi.CustomTimeouts(create=step.timeout, update=step.timeout) if step.timeout else None,
        retain_on_delete=step.retain or None,
    )
    if step.local:
        return local.Command(name, create=create, update=update, delete=field("delete"), stdin=data,
                             environment=environment, add_previous_output_in_env=False, opts=opts)
    return remote.Command(
        name,
        connection=connection,
        create=create,
        update=update,
        delete=field("delete"),
        stdin=data,
        add_previous_output_in_env=False,
        logging=remote.Logging.NONE if step.secret else remote.Logging.STDOUT_AND_STDERR,
        opts=opts,
    )
