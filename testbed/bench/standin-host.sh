#!/usr/bin/env bash
# A stand-in host for scripts/bench/fleet_noop.py: the benchmark's throwaway sshd runs this
# (ForceCommand) in place of every command glm-infra sends, so nothing a step asks for ever runs.
# It refuses nothing, reads and discards the step's stdin (the provider writes all of it), and
# answers only what the program reads to go on:
#   the reboot step (reboot.sh on stdin)  "no-reboot": the local wait step then waits for no new boot
#   hostcheck.py preflight / facts        "{}": the facts the program parses from the last JSON line
#   anything else                         nothing
# The answer depends on the command alone, so a second `pulumi up` sees the same outputs.
# With GLM_STANDIN_LOG set (sshd_config SetEnv), one line per command is appended there (a count).
set -euo pipefail

cmd=${SSH_ORIGINAL_COMMAND:-}
# Read all of stdin (grep -c does not stop at the first match), counting the reboot script's header.
reboot=$(grep -c '^# Managed by glm-infra: reboot ' || true)

if [ -n "${GLM_STANDIN_LOG:-}" ]; then
  echo "command" >> "$GLM_STANDIN_LOG"
fi
if [ "$reboot" -gt 0 ]; then
  echo "no-reboot"
elif [[ $cmd == *hostcheck.py\ preflight* || $cmd == *hostcheck.py\ facts* ]]; then
  echo "{}"
fi
exit 0
