"""The reference the instances agree on, kept in the state folder, and every target judged against it."""

from __future__ import annotations

import json
import os
import time

REFERENCE = "reference.json"
TRANSITION = "transition.json"


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_state(state: str, name: str, *keys: str) -> dict | None:
    """DIR/NAME as a JSON object with string ``keys``: None when there is none; ValueError (naming it) when
    it cannot be read or is not such an object: never taken for "none"."""
    path = os.path.join(state, name)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e})") from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k in keys):
        raise ValueError(f"{path} cannot be read (not an object with {', '.join(keys)})")
    return doc


def answers_of(asked: list[dict]) -> str:
    """Who answered what, for a line: "' 11, 12' from prefill-0, prefill-1; ' x' from decode-0"."""
    by: dict[str, list[str]] = {}
    for a in asked:
        if "text" in a:
            by.setdefault(a["text"], []).append(a["name"])
    return "; ".join(f"{t!r} from {', '.join(names)}" for t, names in sorted(by.items(), key=lambda x: -len(x[1])))


def agreed(asked: list[dict], voters: int, accept: bool = False) -> tuple[str, list[str]] | None:
    """The answer the instances agree on and who gave it: given by at least two of them and by more than
    half of the ``voters`` (every instance, answering or not); with ``accept``, the one answer every
    instance that answers gives, however few. None otherwise."""
    by: dict[str, list[str]] = {}
    for a in asked:
        if a["gate"] and "text" in a:
            by.setdefault(a["text"], []).append(a["name"])
    if accept:
        return (next(iter(by)), sorted(next(iter(by.values())))) if len(by) == 1 else None
    for text, names in by.items():
        if len(names) >= 2 and 2 * len(names) > voters:
            return text, sorted(names)
    return None


def utc(seconds: object) -> str:
    """A time a state file gives (seconds since the epoch), or "an unknown time"."""
    if type(seconds) not in (int, float):
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))  # type: ignore[arg-type]


def reference_line(reference: dict) -> str:
    when = utc(reference.get("recorded"))
    how = "accepted by the operator from" if reference.get("accepted") else "agreed by"
    names = reference.get("agreed") if isinstance(reference.get("agreed"), list) else []
    return (f"reference of {reference['identity']!r}: {reference['text']!r}, {how} {', '.join(map(str, names))} "
            f"({len(names)} of {reference.get('of', '?')} instances) on {when}")


def judge(asked: list[dict], identity: str, state: str, record: bool, accept: bool = False) -> tuple[list[dict], list[str]]:
    """Each target's result ({"name", "role", "ok", "seconds", "line", and "hold": its flag stays as it was})
    and lines about the reference (recorded, or why there is none)."""
    notes: list[str] = []
    results = [dict(a, ok=False) for a in asked]
    for r in results:
        r["hold"] = bool(r.get("down"))
    try:
        reference = read_state(state, REFERENCE, "identity", "text")
    except ValueError as e:  # a damaged reference is not replaced by whatever answers now
        for r in results:
            r.setdefault("line", f"{r['name']}: its reference {e}: remove it to record again")
            r["hold"] = True
        return results, []
    try:
        transition = read_state(state, TRANSITION, "to")
    except ValueError as e:
        transition = None  # (taken out of rotation as without one: the safer way)
        notes.append(f"the transition marker {e}: ignored")
    voters = sum(1 for a in asked if a["gate"])
    if reference is None or reference["identity"] != identity:
        vote = agreed(asked, voters, accept) if record else None
        if vote is None:
            why = (f"no reference of {identity!r} agreed yet" if reference is None else
                   f"its reference is of {reference['identity']!r}, not {identity!r}")
            if record:
                one = "; one cannot be held against another: canary.py accept takes its answer" if voters < 2 else ""
                why += (f": {answers_of(asked)} (at least 2 and more than half of the {voters} "
                        f"instances must agree{one})")
            for r in results:
                r.setdefault("line", f"{r['name']}: {why}")
                r["hold"] = True
            return results, notes
        text, names = vote
        reference = {"identity": identity, "text": text, "agreed": names, "of": voters, "recorded": int(time.time()),
                     **({"accepted": True} if accept else {})}
        write_atomic(os.path.join(state, REFERENCE), json.dumps(reference) + "\n")
        notes.append(f"{reference_line(reference)}: recorded")
        if transition is not None and transition["to"] == identity:
            os.remove(os.path.join(state, TRANSITION))
            transition = None
    else:
        notes.append(reference_line(reference))
    if transition is not None:
        notes.append(f"a change to {transition['to']!r} is rolling out (since {utc(transition.get('since'))}): an "
                     "instance that answers otherwise is not taken out of rotation until every one has rolled")
    for r in results:
        if "line" in r:
            continue
        if r["text"] != reference["text"]:
            r["line"] = f"{r['name']}: answered {r['text']!r} where the reference is {reference['text']!r}"
            r["hold"] = r["pending"] = transition is not None
        else:
            r.update(ok=True, line=f"{r['name']} ok ({r['seconds']:.2f} s)")
    return results, notes
