"""scripts/bench/suite_acct.py: the suite's CPU by program, from the kernel's process accounting (dump-acct)."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import suite_acct  # noqa: E402

# dump-acct's lines as it printed them for a CI run (Debian's acct 6.6.4): name|v3|user|system|elapsed|uid|gid|
# memory|io|pid|ppid|flags|exit code|tty|start, times in 1/100 s.
DUMP = """\
python3         |v3|     6.00|     1.00|    15.00|     0|     0| 15824.00|     0.00|   30583|   30571|     |       0|__      |Mon Dec  7 16:29:56 2026
pulumi          |v3|    14.00|     5.00|    20.00|     0|     0|1376768.00|     0.00|   30606|   30604|S   X|       0|__      |Mon Dec  7 16:29:56 2026
pulumi          |v3|    12.00|     4.00|    18.00|     0|     0|1442304.00|     0.00|   30684|   30582|S   X|       0|__      |Mon Dec  7 16:29:56 2026
python3         |v3|   271.00|    27.00|   308.00|     0|     0| 56752.00|     0.00|   30700|   30699|     |       0|__      |Mon Dec  7 16:29:56 2026
"""


def test_each_programs_cpu_and_processes_add_up_from_the_records():
    run = suite_acct.parse_dump(DUMP)
    assert run == {"python3": (pytest.approx(3.05), 2), "pulumi": (pytest.approx(0.35), 2)}
    table = suite_acct.table(run, top=10).splitlines()
    assert table[2] == "| 3.4 | 4 | 850 | **all** |"
    assert table[3:] == ["| 3.0 | 2 | 1525 | `python3` |", "| 0.3 | 2 | 175 | `pulumi` |"]  # largest first


def test_an_earlier_run_stands_beside_and_a_program_only_one_ran_leaves_the_other_blank():
    before = suite_acct.parse_dump(DUMP)
    after = {"python3": (1.0, 2), "ssh": (0.5, 5)}
    rows = suite_acct.table(after, top=10, against=before).splitlines()
    assert rows[3] == "| 3.0 | 2 | 1525 | 1.0 | 2 | 500 | `python3` |"
    assert "| 0.3 | 2 | 175 |  |  |  | `pulumi` |" in rows and "|  |  |  | 0.5 | 5 | 100 | `ssh` |" in rows


@pytest.mark.parametrize("line", ["", "python3 |v3| 6.00", "python3|v2|1|1|1|0|0|1|0|1|1||0|__|Mon Dec  7 16:29:56 2026",
                                  "garbage"])
def test_a_line_that_is_no_record_is_an_error_not_a_smaller_table(line):
    with pytest.raises(ValueError, match="not a v3 record"):
        suite_acct.parse_dump(DUMP + line + "\n")
