# shellcheck shell=bash
# Debian packages the simulated cluster, the team-state tests, the router front's test (nginx, in front of
# the real vllm-router on loopback) and the TypeScript example (Node.js, npm) need on this machine
# (installed when missing, as root).

ensure_host_deps() {
  local need=() pkg
  for pkg in debootstrap:debootstrap systemd-nspawn:systemd-container dpkg-scanpackages:dpkg-dev \
    curl:curl ssh:openssh-client gpg:gnupg ip:iproute2 tc:iproute2 nft:nftables node:nodejs npm:npm \
    nginx:nginx; do
    command -v "${pkg%%:*}" >/dev/null 2>&1 || need+=("${pkg#*:}")
  done
  python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
  command -v psql >/dev/null 2>&1 || need+=(postgresql-client)
  compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' >/dev/null || need+=(postgresql)
  [ "${#need[@]}" -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || { echo "error: need root to apt-get install ${need[*]}" >&2; return 1; }
  echo "== apt-get install ${need[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
  # The tests run nginx with a configuration of their own: the service Debian starts with the package (its
  # default site on port 80) is stopped, where there is a systemd to have started it.
  if [[ " ${need[*]} " == *" nginx "* ]] && [ -d /run/systemd/system ]; then
    systemctl disable --now --quiet nginx
  fi
}
