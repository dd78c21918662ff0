"""Where the whole suite's CPU goes, by program: every process the run starts, on this machine and on the
simulated hosts alike, counted by the kernel's process accounting (BSD acct) as it exits.

    venv/bin/python scripts/bench/suite_acct.py [--top 40] [--keep FILE] [-- SCRIPTS/TEST ARGS]   (as root)
    venv/bin/python scripts/bench/suite_acct.py --report FILE [--against FILE] [--top 40]

It turns accounting on into a file of its own (``accton``, Debian's acct package: apt-get install acct), runs
scripts/test (what .ci/run runs), turns it off, and prints each program's CPU-seconds (user and system),
processes and CPU per process, largest first; ``--against`` puts an earlier run's file beside it. Where
suite_cpu.py says which tests take the CPU, this says which programs do: SSH clients, Pulumi's CLI,
Python on the hosts, shellcheck.

How to read the names: the kernel records a process's command name (15 characters) when its last thread
exits, so a multi-threaded process is named after that thread (a Pulumi program's Python as
``event_engine`` or ``grpc_global_tim``, one that imported pyarrow as ``jemalloc_bg_thd``); a script started
through ``#!/usr/bin/env python3`` is ``python3``; a process that exec'd another program is counted under
the last name, with the CPU of what ran before the exec. A process still running at the end is not counted
(the suite stops everything it starts). Accounting is machine-wide: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TICKS = 100  # dump-acct's unit for user and system time (AHZ)


def by_command(acct_file: Path) -> dict[str, tuple[float, int]]:
    """{command name: (CPU-seconds, processes)} of an accounting file."""
    return parse_dump(subprocess.run(["dump-acct", str(acct_file)], capture_output=True, text=True, check=True).stdout)


def parse_dump(text: str) -> dict[str, tuple[float, int]]:
    """{command name: (CPU-seconds, processes)} of dump-acct's lines (name|v3|user|system|elapsed|…, times in
    1/100 s). A line of another shape is an error: a misread file never gives a table."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for number, line in enumerate(text.splitlines(), 1):
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 15 or fields[1] != "v3":
            raise ValueError(f"dump-acct line {number} is not a v3 record: {line!r}")
        totals[fields[0]][0] += (float(fields[2]) + float(fields[3])) / TICKS
        totals[fields[0]][1] += 1
    return {name: (cpu, n) for name, (cpu, n) in totals.items()}


def table(run: dict[str, tuple[float, int]], top: int, against: dict[str, tuple[float, int]] | None = None) -> str:
    """A markdown table: each program's CPU-seconds, processes and milliseconds per process (``against``'s first,
    then ``run``'s), the ``top`` programs by CPU, after the totals."""
    runs = [r for r in (against, run) if r is not None]

    def cells(row: tuple[float, int] | None) -> list[str]:
        return [f"{row[0]:.1f}", str(row[1]), f"{1000 * row[0] / row[1]:.0f}"] if row else ["", "", ""]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(values) + " |"

    totals = [(sum(c for c, _ in r.values()), sum(n for _, n in r.values())) for r in runs]
    lines = [line(["CPU-s", "processes", "ms each"] * len(runs) + ["program"]), line(["---"] * (3 * len(runs) + 1)),
             line([c for t in totals for c in cells(t)] + ["**all**"])]
    names = sorted({n for r in runs for n in r}, key=lambda n: -sum(r.get(n, (0, 0))[0] for r in runs))
    lines += [line([c for r in runs for c in cells(r.get(name))] + [f"`{name}`"]) for name in names[:top]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40, help="programs listed (default 40)")
    parser.add_argument("--report", type=Path, help="only print the table of an earlier run's accounting file")
    parser.add_argument("--against", type=Path, help="an earlier run's accounting file, printed beside")
    parser.add_argument("--keep", type=Path, help="where to keep this run's accounting file (default: a temp file)")
    parser.add_argument("test_args", nargs="*", help="after --: arguments for scripts/test")
    args = parser.parse_args()
    against = by_command(args.against) if args.against else None
    if args.report:
        print(table(by_command(args.report), args.top, against))
        return 0
    for tool in ("accton", "dump-acct"):
        if shutil.which(tool) is None:
            print(f"error: {tool} not found: apt-get install acct", file=sys.stderr)
            return 2
    if os.geteuid() != 0:
        print("error: process accounting needs root, as scripts/test does", file=sys.stderr)
        return 2
    acct = args.keep or Path(tempfile.mkstemp(prefix="glm-suite-acct-")[1])
    acct.write_bytes(b"")
    subprocess.run(["accton", str(acct)], check=True, stdout=subprocess.DEVNULL)
    try:
        status = subprocess.run([str(ROOT / "scripts/test"), *args.test_args], cwd=ROOT).returncode
    finally:
        subprocess.run(["accton", "off"], check=True, stdout=subprocess.DEVNULL)
    print(f"\naccounting file: {acct}")
    print(table(by_command(acct), args.top, against))
    return status


if __name__ == "__main__":
    sys.exit(main())
