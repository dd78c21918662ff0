"""Turn a ``Step`` into a ``command:remote:Command`` (or ``command:local:Command``) — the one place
components touch the provider."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path

import pulumi
import pulumi_command.local as local
import pulumi_command.remote as remote

from glm_infra.roles.roll import runs
from glm_infra.steps import TRIGGERS_TOKEN, Step, digest, keyed_digest

# The stack's trigger key: 32 random bytes as hex, made once (the command never changes, so it never
# runs again) and kept in the state as a secret. Changing this text makes a new key: every step with a
# secret trigger would re-run (the vLLM instances and the router restart), so leave it as it is.
TRIGGER_KEY_COMMAND = "od -An -N32 -tx1 /dev/urandom | tr -d ' \\n'"
_TRIGGER_KEY: ContextVar[pulumi.Output[str] | None] = ContextVar("glm_infra_trigger_key", default=None)
# The stack's relay key, made the same way (another command text: another resource's, never the trigger key):
# what the weights and warm-cache relays send between hosts is signed with it (agent/weights/).
# Replacing the resource (pulumi up --replace URN) makes a new key: every host's key file is written again.
RELAY_KEY_COMMAND = "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'"


def trigger_key(name: str, parent: pulumi.Resource) -> pulumi.Output[str]:
    """Register the stack's trigger key (a ``command:local:Command`` whose stdout is the key, a secret)
    and key with it the digest of every secret trigger of the steps registered after this call in this
    program (Cluster and Hosts call it first). Returns the key."""
    made = local.Command(name, create=TRIGGER_KEY_COMMAND, logging=local.Logging.NONE, add_previous_output_in_env=False,
                         opts=pulumi.ResourceOptions(parent=parent, additional_secret_outputs=["stdout", "stderr"]))
    key = pulumi.Output.secret(made.stdout)
    _TRIGGER_KEY.set(key)
    return key


def relay_key(name: str, parent: pulumi.Resource) -> pulumi.Output[str]:
    """Register the stack's relay key (a ``command:local:Command`` whose stdout is the key, a secret, made once
    and kept in the state) and return it."""
    made = local.Command(name, create=RELAY_KEY_COMMAND, logging=local.Logging.NONE, add_previous_output_in_env=False,
                         opts=pulumi.ResourceOptions(parent=parent, additional_secret_outputs=["stdout", "stderr"]))
    return pulumi.Output.secret(made.stdout)


_RUN_FAILED_HOOK: ContextVar[pulumi.ErrorHook | None] = ContextVar("glm_infra_run_failed_hook", default=None)


def record_failures(name: str, lease_root: Path | None) -> pulumi.ErrorHook | None:
    """Bind to every step registered after this call in this program an error hook that records, in
    ``lease_root`` (the stack's lease folder, runs.lease_root), that this run failed at that step: the hosts
    of this run waiting for a turn read it and stop (runs.py says why). None (no host takes turns): no hook.
    The hook never retries the step, and never fails itself: what it cannot record is a warning, and the
    waiters then keep their bound."""
    if lease_root is None:
        _RUN_FAILED_HOOK.set(None)
        return None

    def on_error(args: pulumi.ErrorHookArgs) -> bool:
        what = f"{args.name} ({args.failed_operation})"
        try:
            run = runs.this_run()
            if run is None:
                raise OSError("no pulumi process above the program to name the run")
            runs.record_failure(lease_root, run, what)
        except (OSError, ValueError) as e:
            pulumi.log.warn(f"{what} failed, and the hosts of this run waiting for a turn cannot be told ({e}): "
                            "they wait out their bound")
        return False

    hook = pulumi.ErrorHook(f"{name}-run-failed", on_error)
    _RUN_FAILED_HOOK.set(hook)
    return hook


def inherited(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """The component's own ``depends_on``: children must carry it themselves, the engine only orders
    resources by the dependencies each registration names."""
    deps = (opts.depends_on if opts else None) or []
    return list(deps) if isinstance(deps, (list, tuple)) else [deps]


def with_triggers(command: pulumi.Input[str], triggers: Sequence[pulumi.Input[str]],
                  key: pulumi.Output[str] | None = None) -> pulumi.Input[str]:
    """``command`` prefixed by a digest of the trigger values, so a changed value changes the command.

    pulumi-command replaces a resource whose ``triggers`` change (create the new, then run the old
    one's delete — which would undo the new). A changed command is an in-place update instead.

    When a trigger is a secret (or made from one: a digest of a secret file), the digest is keyed with
    the stack's trigger key: a plain one could be checked offline against a guessed secret. Keyed, it
    reveals nothing, so the command is not kept secret (its diffs stay readable). Without a key (a
    component registered outside Cluster and Hosts) such a command stays secret. Triggers without a
    secret keep their plain digest: their commands are what they were."""
    if not triggers:
        return command
    values = pulumi.Output.all(*triggers)
    secret = pulumi.Output.from_input(values.is_secret())

    def stamp(vs: list) -> pulumi.Input[str]:
        command, parts, is_secret = vs[0], [str(v) for v in vs[1]], vs[2]
        if is_secret and key is not None:
            # Only these depend on the key (so only these wait for it, unknown in a preview before it exists).
            return key.apply(lambda k: _stamp(command, keyed_digest(k, *parts)))
        return _stamp(command, digest(*parts))

    joined = pulumi.Output.all(command, values, secret).apply(stamp)
    return pulumi.Output.unsecret(joined) if key is not None else joined


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
    moved_from: Sequence[pulumi.Input[str]] = (),
) -> remote.Command | local.Command:
    """Register ``step``. Its options (timeout, retention, logging, local or remote) are fixed when the
    program runs; its commands and stdin come from ``live`` when they depend on values another
    resource produces (addresses), else from ``step``. ``stdin`` overrides both (secret files).
    ``moved_from``: the URNs of the parents it had before (a component that no longer exists): aliases, so
    that a deployed step stays the same resource (nothing created again, no delete run)."""

    def field(attr: str) -> pulumi.Input:
        return live.apply(lambda s: getattr(s, attr)) if live is not None else getattr(step, attr)

    data = stdin if stdin is not None else (field("stdin") if step.stdin is not None else None)
    if step.secret and data is not None:
        data = pulumi.Output.secret(data)
    all_triggers: list[pulumi.Input[str]] = [
        *(live.apply(lambda s: digest(*s.triggers)) if live is not None else digest(*step.triggers),)
    ] if step.triggers else []
    all_triggers += list(triggers)
    key = _TRIGGER_KEY.get()
    create = with_triggers(field("create"), all_triggers, key)
    update = with_triggers(field("update"), all_triggers, key) if step.update is not None else create
    opts = pulumi.ResourceOptions(
        parent=parent,
        depends_on=list(depends_on),
        additional_secret_outputs=(["stdin", "stdout"] if step.secret_output else ["stdin"]) if step.secret else None,
        custom_timeouts=pulumi.CustomTimeouts(create=step.timeout, update=step.timeout) if step.timeout else None,
        retain_on_delete=step.retain or None,
        aliases=[pulumi.Alias(parent=urn) for urn in moved_from] or None,
        hooks=pulumi.ResourceHookBinding(on_error=[hook]) if (hook := _RUN_FAILED_HOOK.get()) else None,
    )
    if step.local:
        return local.Command(name, create=create, update=update, delete=field("delete"), stdin=data,
                             environment=environment, add_previous_output_in_env=False, opts=opts)
    # A step keeps the delete command it was created with: the provider runs a step's update (or
    # create) when its delete alone changes, and on a deployed cluster that would re-run every step
    # (host-drain's update drains its host). A delete fixed later reaches the steps created after it.
    opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(ignore_changes=["delete"]))
    return remote.Command(
        name,
        connection=connection,
        create=create,
        update=update,
        delete=field("delete_command"),
        stdin=data,
        add_previous_output_in_env=False,
        logging=remote.Logging.NONE if step.secret else remote.Logging.STDOUT_AND_STDERR,
        opts=opts,
    )
