# shellcheck shell=bash
# The project virtualenv (Pulumi.yaml: virtualenv venv), made once with the pinned dependencies.

ensure_venv() {
  local stamp=venv/.glm-infra-deps
  local want
  want=$(cat pyproject.toml requirements.txt constraints.txt | sha256sum | cut -c1-16)
  if [ -x venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  echo "== virtualenv: installing pinned dependencies into venv/"
  [ -x venv/bin/python ] || python3 -m venv venv
  # Every pip run in venv/ keeps the pins, not only ours: the Pulumi engine runs
  # `pip install --upgrade pip setuptools wheel` in the component provider's virtualenv (this one,
  # provider/PulumiPlugin.yaml) on each `pulumi package add|get-schema ./provider`. Unpinned, that
  # replaced pip under a concurrent `pulumi up`, whose `pip list` then failed.
  printf '%s\n' "# scripts/lib/venv.sh: pip in this venv installs only the program's pinned versions." \
    "[install]" "constraint = $PWD/constraints.txt" > venv/pip.conf
  # uv installs the pins (about 5 s from its cache, 40 s with pip); its cache is the project's.
  venv/bin/python -m pip install -q --disable-pip-version-check pip setuptools wheel uv
  UV_CACHE_DIR="${GLM_INFRA_CACHE:-$HOME/.cache/glm-infra}/uv" venv/bin/uv pip install -q --python venv/bin/python \
    -r requirements.txt
  echo "$want" > "$stamp"
}
