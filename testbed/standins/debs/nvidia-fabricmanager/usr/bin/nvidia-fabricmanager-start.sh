#!/bin/sh
# Stand-in for the fabric manager's start wrapper. --mode precheck checks what an NVLink 5 system
# (every simulated B300) needs before the fabric manager may start: the ib_umad module loaded (the
# simulated kernel's: /run/glm-sim/modules), nvlsm and ibstat (infiniband-diags) installed; it refuses
# with the real wrapper's message otherwise. --mode start starts NVLSM, from the nvlsm package, then the
# fabric manager, as NVIDIA's driver container runs it (gpu-driver-container ubuntu24.04/nvidia-driver)
# and as the real unit's processes show (/opt/nvidia/nvlsm/sbin/nvlsm -F <nvlsm.conf> -B --pid_file
# <pid file>, then nv-fabricmanager -c <fabricmanager.cfg>).
set -e

root=${GLM_SIM_ROOT:-}  # empty on a host; a temp dir when tests run this script
fm_config=/usr/share/nvidia/nvswitch/fabricmanager.cfg
nvlsm_config=/usr/share/nvidia/nvlsm/nvlsm.conf
nvlsm_pid=/var/run/nvidia-fabricmanager/nvlsm.pid
mode=
while [ $# -gt 0 ]; do
	case "$1" in
		--mode) mode=$2 ;;
		--fm-config-file) fm_config=$2 ;;
		--fm-pid-file) ;;
		--nvlsm-config-file) nvlsm_config=$2 ;;
		--nvlsm-pid-file) nvlsm_pid=$2 ;;
		*) echo "nvidia-fabricmanager-start.sh: unknown option $1" >&2; exit 2 ;;
	esac
	shift 2
done

nvlsm=/opt/nvidia/nvlsm/sbin/nvlsm
precheck() {
	echo "Detected NVL5+ system"
	if [ ! -e "$root/run/glm-sim/modules/ib_umad" ]; then
		echo "Kernel module \"ib_umad\" has not been loaded, fabric manager cannot be started" >&2
		exit 1
	fi
	if [ ! -x "$root$nvlsm" ]; then
		echo "\"$nvlsm\" does not exist, install the nvlsm package" >&2
		exit 1
	fi
	command -v ibstat >/dev/null 2>&1 || { echo "ibstat not found, install the infiniband-diags package" >&2; exit 1; }
}

case "$mode" in
	precheck) precheck ;;
	start)
		precheck
		mkdir -p "$root$(dirname "$nvlsm_pid")"
		"$root$nvlsm" -F "$nvlsm_config" -B --pid_file "$root$nvlsm_pid" &
		exec "$root/usr/bin/nv-fabricmanager" -c "$fm_config"
		;;
	*) echo "nvidia-fabricmanager-start.sh: --mode precheck|start (only these are simulated)" >&2; exit 2 ;;
esac
