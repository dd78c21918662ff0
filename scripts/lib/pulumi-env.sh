# shellcheck shell=bash
# Environment for running the Pulumi CLI here: the toolchain built by scripts/toolchain, no network
# beyond the registries, a local file backend inside the repo and the passphrase secrets provider.
# shellcheck source=scripts/lib/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=scripts/lib/versions.sh
. "$(dirname "${BASH_SOURCE[0]}")/versions.sh"

TOOLCHAIN_BIN="$GLM_INFRA_CACHE/toolchain/pulumi-v$PULUMI_VERSION/bin"
# The language host runs the program in Pulumi.yaml's `virtualenv` (venv/), so only the CLI goes on PATH.
export PATH="$TOOLCHAIN_BIN:$PATH"
export PULUMI_HOME="${PULUMI_HOME:-$GLM_INFRA_CACHE/pulumi-home}"
export PULUMI_BACKEND_URL="${PULUMI_BACKEND_URL:-file://$REPO_ROOT/.pulumi-state}"
export PULUMI_SKIP_UPDATE_CHECK=true
export PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION=true
export PULUMI_AUTOMATION_API_SKIP_VERSION_CHECK=true
mkdir -p "$PULUMI_HOME"
# Pulumi's automatic log (on in 3.260, with no switch): every verbose line the engine makes, property values
# included, gzip-compressed into $PULUMI_HOME/logs/ on each run. It is about two thirds of the engine's CPU in
# a preview (24 hosts: 5.2 CPU-s with it, 1.5 without; docs/PERFORMANCE.md "Fleet-sized preview"), and the
# test suite left 120 MB of it in a quarter of an hour. A file where its folder goes turns it off (the CLI
# then runs without one). Only in glm-infra's own PULUMI_HOME: one you set is yours (docs/DEPLOYING.md, step 5,
# says how to turn yours off).
GLM_INFRA_PULUMI_HOME="$GLM_INFRA_CACHE/pulumi-home"
if [ "$PULUMI_HOME" = "$GLM_INFRA_PULUMI_HOME" ] && [ ! -f "$PULUMI_HOME/logs" ]; then
  rm -rf "$PULUMI_HOME/logs"
  : > "$PULUMI_HOME/logs"
fi
case "$PULUMI_BACKEND_URL" in file://*) mkdir -p "${PULUMI_BACKEND_URL#file://}" ;; esac
