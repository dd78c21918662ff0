# shellcheck shell=bash
# Debian packages the simulated cluster, the team-state tests and the TypeScript example (Node.js, npm)
# need on this machine (installed when missing, as root).

ensure_host_deps() {
  local need=() pkg
  for pkg in debootstrap:debootstrap systemd-nspawn:systemd-container dpkg-scanpackages:dpkg-dev \
    curl:curl ssh:openssh-client gpg:gnupg ip:iproute2 tc:iproute2 nft:nftables node:nodejs npm:npm; do
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
}
