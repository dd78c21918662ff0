# shellcheck shell=bash
# Shared by the scripts: where the cache lives and how to say things.

GLM_INFRA_CACHE=${GLM_INFRA_CACHE:-$HOME/.cache/glm-infra}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
