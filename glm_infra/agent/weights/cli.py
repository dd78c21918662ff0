"""The command line: the relay and serve commands, and the dispatch of every command."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from . import base
from .base import REVISION, StageError, log
from .signing import EXIT_FORGED, Forged, relay_key
from .relay import Relay, files_server, start_relay, wait_for_children
from .revisions import cmd_prune, cmd_remove, cmd_stage, cmd_verify, staged_whole
from .install import cmd_install


def cmd_relay(args: argparse.Namespace) -> int:
    """A staged revision served as a relay parent serves it (every file published, complete) until each child
    said it has every file or went silent for --stall seconds: the pool's first host runs it as a transient
    unit, so the steps of the hosts that copy from it can follow its own. Exit 1 naming a child that left
    before it had every file."""
    if not args.relay_key_file:
        raise StageError("relay needs --relay-key-file F (the stack's relay key): a relay is never served by its "
                         "port alone")
    key = relay_key(args.relay_key_file)
    root, manifest = staged_whole(args, "nothing to serve")
    relay = Relay(args.revision, args.name)
    relay.key = key
    relay.commit = manifest.get("commit")
    relay.adopt(manifest["files"])
    for e in relay.files:
        relay.publish(e["path"])
    relay.publish(complete=True)
    children = [c for c in args.children.split(",") if c]
    server = start_relay(relay, root, args.bind, args.stall)
    try:
        notify_ready()  # (a transient unit of Type=notify: its start, and the step, wait for this)
        log(f"{args.revision}: serving {len(relay.files)} files on {args.bind} to {', '.join(children)}")
        left = wait_for_children(relay, children, args.stall)
    finally:
        server.shutdown()
        server.server_close()
    if left:
        raise StageError(f"{', '.join(left)} stopped copying from this host before they had every file")
    log(f"relay on {args.bind} stopped: every host copying from here is done or left")
    return 0


def notify_ready() -> None:
    """Tell systemd this service is ready (sd_notify READY=1), when it runs as a unit of Type=notify."""
    where = os.environ.get("NOTIFY_SOCKET")
    if not where:
        return
    address = "\0" + where[1:] if where.startswith("@") else where  # "@": an abstract socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(address)
        s.sendall(b"READY=1")


def cmd_serve(args: argparse.Namespace) -> int:
    """Every file of a folder: the mirror stand-in (a relay is ``relay`` or ``stage --serve``, signed)."""
    with files_server(args.dir, args.bind) as httpd:
        httpd.serve_forever()
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line (the module's docstring says what each option means)."""
    ap = argparse.ArgumentParser(prog="weights.py", description=sys.modules[__package__].__doc__,  # pragma: no mutate
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("--role", choices=["seed", "peer"], default="seed")
    s.add_argument("--source", choices=["huggingface", "mirror", "directory", "local"], default="mirror")
    s.add_argument("--url")
    s.add_argument("--from", dest="from_dir")
    s.add_argument("--include", action="append", default=[])
    s.add_argument("--kind", action="append", default=[])
    s.add_argument("--repo")
    s.add_argument("--hf-python", default="/opt/glm-infra/hf/bin/python")
    s.add_argument("--token-file")
    s.add_argument("--relay-key-file")
    s.add_argument("--peer", action="append", default=[])
    s.add_argument("--serve")
    s.add_argument("--children", default="")
    s.add_argument("--name", default=os.uname().nodename)
    s.add_argument("--stall", type=float, default=120)
    s.add_argument("--revision", default="")
    s.add_argument("--path", required=True)
    s.add_argument("--margin-gb", type=float, default=10)
    s.add_argument("--timeout", type=int, default=86400)
    for name in ("verify", "prune"):
        p = sub.add_parser(name)
        p.add_argument("--revision", required=True)
        p.add_argument("--path", required=True)
    sub.choices["verify"].add_argument("--quick", action="store_true")
    sub.add_parser("remove").add_argument("--path", required=True)
    i = sub.add_parser("install")
    i.add_argument("--revision", required=True)
    i.add_argument("--path", required=True)
    i.add_argument("--into", required=True)
    i.add_argument("--owner")
    i.add_argument("--include", action="append", default=[])
    i.add_argument("--kind", action="append", default=[])
    r = sub.add_parser("relay")
    r.add_argument("--revision", required=True)
    r.add_argument("--path", required=True)
    r.add_argument("--bind", required=True)
    r.add_argument("--children", required=True)
    r.add_argument("--name", default=os.uname().nodename)
    r.add_argument("--stall", type=float, default=120)
    r.add_argument("--relay-key-file")
    v = sub.add_parser("serve")
    v.add_argument("--dir", required=True)
    v.add_argument("--bind", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    base.HOST = getattr(args, "name", None) or base.HOST  # what log() and every message start with
    if args.cmd in ("verify", "prune", "install", "relay") or (args.cmd == "stage" and args.source != "local"):
        if not REVISION.fullmatch(args.revision):  # a folder name under PATH.revisions, as the stack's rule
            print(f"{base.HOST}: weights: {args.revision!r} is not a revision", file=sys.stderr)
            return 1
    handlers = {"stage": cmd_stage, "verify": cmd_verify, "prune": cmd_prune, "remove": cmd_remove,
                "install": cmd_install, "relay": cmd_relay, "serve": cmd_serve}
    try:
        return handlers[args.cmd](args)
    except StageError as e:
        print(f"{base.HOST}: weights: {e}", file=sys.stderr)
        return EXIT_FORGED if isinstance(e, Forged) else 1
