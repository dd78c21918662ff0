"""AIPerf's output of one bucket read into the gate's Bucket (read_summary, read_records: pure, text in;
read_result, failed_records: the same from the files): its summary (profile_export_aiperf.json) or, when
AIPerf wrote none because every request failed, its per-request records (profile_export.jsonl). Whatever is absent, partial or unreadable is named in
``Bucket.missing`` (the file and the key) and left unmeasured (None), never read as 0: the verdict
fails the bucket for it.

The schema is AIPerf 0.13.0's (sla-client.txt): each metric an object with its unit and avg, p50,
p99, min, count (the requests it was measured on)…; time_to_first_token and inter_token_latency exist
only for answers that were streamed, error_request_count only when a request failed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .sla_verdict import Bucket

SUMMARY = "profile_export_aiperf.json"
RECORDS = "profile_export.jsonl"
TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "sec": 1.0}  # AIPerf's time units (MetricTimeUnit), in seconds
STATS = (("mean", "avg"), ("p50", "p50"), ("p99", "p99"))  # the gate's name, AIPerf's
NOT_STREAMED = " (AIPerf measures it on streamed answers only: were they streamed?)"
WHY = {"time_to_first_token": NOT_STREAMED, "inter_token_latency": NOT_STREAMED}


def unread(context: int, why: str) -> Bucket:
    """A bucket of which nothing could be read, and why."""
    return Bucket(context, None, None, 0, 0, missing=[why])


def read_result(path: Path, context: int) -> Bucket:
    """The bucket AIPerf's summary file describes (a file that cannot be read: a bucket naming it)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        return unread(context, f"{SUMMARY} could not be read ({e})")
    return read_summary(text, context)


def failed_records(path: Path, context: int) -> Bucket:
    """The bucket AIPerf's per-request records describe, when it wrote no summary."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        return unread(context, f"{RECORDS} could not be read ({e})")
    return read_records(text, context)


def read_summary(text: str, context: int) -> Bucket:
    """The bucket AIPerf's summary describes: TTFT and TPOT (its inter-token latency) in seconds, the
    requests answered and failed, the shortest answer's output tokens."""
    try:
        d = json.loads(text)
    except ValueError as e:
        return unread(context, f"{SUMMARY} is not JSON ({e})")
    if not isinstance(d, dict):
        return unread(context, f"{SUMMARY} is not a JSON object")
    missing: list[str] = []
    requests = _count(d, "request_count", missing)
    errors, error_summary = _errors(d, requests, missing)
    if d.get("was_cancelled", False) is not False:
        missing.append(f"{SUMMARY}: was_cancelled is {_show(d['was_cancelled'])} (the run was cut short)")
    if d.get("is_complete", True) is not True:
        reason = f" ({str(d['incomplete_reason'])[:200]})" if d.get("incomplete_reason") else ""
        missing.append(f"{SUMMARY}: is_complete is {_show(d['is_complete'])}{reason}")
    ttft = tpot = shortest = None
    if requests:  # nothing answered: nothing measured, and the verdict counts the requests
        ttft = _latency(d, "time_to_first_token", requests, missing)
        tpot = _latency(d, "inter_token_latency", requests, missing)
        shortest = _tokens(d, "output_sequence_length", requests, missing)
    return Bucket(context, ttft, tpot, requests or 0, errors, error_summary, output_tokens=shortest, missing=missing)


def read_records(text: str, context: int) -> Bucket:
    """A bucket from AIPerf's per-request records alone (it writes no summary when every request failed):
    the requests that failed with the first error; any answered one means the summary is missing."""
    answered, errors, unreadable = 0, [], []
    for n, record in enumerate(text.splitlines(), 1):
        if not record.strip():
            continue
        r = _json_object(record)
        if r is None:
            unreadable.append(n)
        elif r.get("error") is None:
            answered += 1
        else:
            errors.append(r["error"])
    missing = []
    if unreadable:
        missing.append(f"{RECORDS}: {len(unreadable)} lines are not JSON objects (the first: line {unreadable[0]})")
    if answered:
        missing.append(f"no {SUMMARY}, though {RECORDS} holds {answered} answered requests (AIPerf stopped "
                       "before its summary?)")
    if not (answered or errors or unreadable):
        missing.append(f"{RECORDS} holds no request")
    return Bucket(context, None, None, answered, len(errors), errors[:1], missing=missing)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        r = json.loads(text)
    except ValueError:
        return None
    return r if isinstance(r, dict) else None


def _show(v: Any) -> str:
    return json.dumps(v)[:100]


def _metric(d: dict[str, Any], key: str, missing: list[str]) -> dict[str, Any] | None:
    m = d.get(key)
    if m is None:
        missing.append(f"{SUMMARY}: no {key}{WHY.get(key, '')}")
        return None
    if not isinstance(m, dict):
        missing.append(f"{SUMMARY}: {key} is {_show(m)}, not an object")
        return None
    return m


def _number(m: dict[str, Any], key: str, field: str, missing: list[str], positive: bool = False) -> float | None:
    """m[field], a finite number above 0 (``positive``) or of 0 or more; else named, None."""
    if field not in m:
        missing.append(f"{SUMMARY}: {key} has no {field}")
        return None
    v = m[field]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        least = "above 0" if positive else "of 0 or more"
        missing.append(f"{SUMMARY}: {key}.{field} is {_show(v)}, not a number {least}")
        return None
    return float(v)


def _whole(m: dict[str, Any], key: str, field: str, missing: list[str]) -> int | None:
    v = _number(m, key, field, missing)
    if v is not None and v != int(v):
        missing.append(f"{SUMMARY}: {key}.{field} is {v:g}, not a whole number")
        return None
    return None if v is None else int(v)


def _count(d: dict[str, Any], key: str, missing: list[str]) -> int | None:
    m = _metric(d, key, missing)
    return None if m is None else _whole(m, key, "avg", missing)


def _covers(m: dict[str, Any], key: str, requests: int, missing: list[str]) -> bool:
    """Whether a metric was measured on every answered request (AIPerf's ``count``)."""
    n = _whole(m, key, "count", missing)
    if n is not None and n != requests:
        missing.append(f"{SUMMARY}: {key} covers {n} of the {requests} answered requests{WHY.get(key, '')}")
    return n == requests


def _errors(d: dict[str, Any], requests: int | None, missing: list[str]) -> tuple[int, list[Any]]:
    """The failed requests: the most any of AIPerf's counts says (its error count, completed less
    answered, the errors its summary lists), and that summary."""
    counts = [0]
    if "error_request_count" in d:
        counts.append(_count(d, "error_request_count", missing) or 0)
    if "completed_request_count" in d:
        completed = _count(d, "completed_request_count", missing)
        if completed is not None and requests is not None:
            counts.append(completed - requests)
    listed = d.get("error_summary", [])
    if not isinstance(listed, list):
        missing.append(f"{SUMMARY}: error_summary is {_show(listed)}, not a list")
        listed = []
    counts.append(sum(_listed(e) for e in listed))
    return max(counts), listed


def _listed(entry: Any) -> int:
    """How many requests one entry of error_summary counts (at least the one it lists)."""
    n = entry.get("count") if isinstance(entry, dict) else None
    return max(n, 1) if isinstance(n, int) and not isinstance(n, bool) else 1


def _latency(d: dict[str, Any], key: str, requests: int, missing: list[str]) -> dict[str, float] | None:
    m = _metric(d, key, missing)
    if m is None:
        return None
    unit = m.get("unit")
    if not isinstance(unit, str) or unit not in TIME_UNITS:
        missing.append(f"{SUMMARY}: {key}.unit is {_show(unit)}, not a time unit AIPerf writes "
                       f"({', '.join(TIME_UNITS)})")
        return None
    values = {name: _number(m, key, field, missing, positive=True) for name, field in STATS}
    covered = _covers(m, key, requests, missing)
    if not covered or None in values.values():
        return None
    return {name: v * TIME_UNITS[unit] for name, v in values.items()}  # type: ignore[operator]


def _tokens(d: dict[str, Any], key: str, requests: int, missing: list[str]) -> float | None:
    m = _metric(d, key, missing)
    if m is None:
        return None
    if m.get("unit") != "tokens":
        missing.append(f"{SUMMARY}: {key}.unit is {_show(m.get('unit'))}, not tokens")
        return None
    shortest = _number(m, key, "min", missing)
    covered = _covers(m, key, requests, missing)
    return shortest if covered else None
