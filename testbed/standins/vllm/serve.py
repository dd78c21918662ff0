"""``vllm serve`` of the stand-in.

First the checks a real vLLM fails on (GPU count, staged weights, NIXL side channel, ports), then
llm-d-inference-sim as a child on a free port behind a small threaded reverse proxy on --host:--port.
The proxy owns what the simulator does not model, the way vLLM's API server behaves: the port is
reserved but refuses connections until the weights are "loaded"; SIGTERM closes the listening
socket and idle keep-alive connections at once (new connections are refused, so a router sends them
elsewhere) while requests already accepted run to completion within --shutdown-timeout;
VLLM_API_KEY; and one log line per request naming the P/D role, so the journal shows a request going
through prefill, then decode.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import hmac
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from . import startup

ROLE_OF_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "prefill+decode"}
# Requests whose kv_transfer_params are logged: the ones the P/D router sends.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# Paths vLLM serves without the API key.
OPEN_PATHS = ("/health", "/metrics")
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
PR_SET_PDEATHSIG = 1
# Faults a test plants for one instance, by its port (under /run: gone at the next boot).
FAULTS_DIR = os.environ.get("GLM_SIM_VLLM_FAULTS", "/run/glm-sim/vllm-faults")
# Words greedy answers are made of (llm-d-inference-sim ignores temperature: its text is random).
GREEDY_WORDS = ("the", "capital", "of", "France", "is", "Paris", "and", "its", "river", "Seine", "runs", "through",
                "city", "a", "large", "old", "in", "Europe")
# After SIGTERM, keep-alive connections are still served this long (with Connection: close).
KEEPALIVE_GRACE_S = 3.0


class ServeError(Exception):
    """A startup failure a real vLLM would also have; printed as one line, exit 1."""


def log(line: str) -> None:
    # One write per line: request threads log concurrently and the journal reads whole lines.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --- the checks -------------------------------------------------------------------------------


def check_devices(args: argparse.Namespace) -> None:
    needed = args.tensor_parallel_size * args.data_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        raise ServeError(f"CUDA_VISIBLE_DEVICES is not set; -tp {args.tensor_parallel_size} × -dp "
                         f"{args.data_parallel_size} needs {needed} GPUs")
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if len(set(devices)) != len(devices):
        raise ServeError(f"CUDA_VISIBLE_DEVICES={visible} lists a GPU twice")
    if len(devices) != needed:
        raise ServeError(f"CUDA_VISIBLE_DEVICES={visible} lists {len(devices)} GPUs but -tp "
                         f"{args.tensor_parallel_size} × -dp {args.data_parallel_size} needs {needed}")


# GLM-5.2's context, for a config.json that does not say.
DEFAULT_CONTEXT = 1048576


def check_model(args: argparse.Namespace) -> None:
    model = Path(args.model)
    if not model.is_dir():
        raise ServeError(f"model {args.model} is not a directory (weights not staged?)")
    if not (model / "config.json").is_file():
        raise ServeError(f"model {args.model} has no config.json (weights not staged?)")
    if args.max_model_len is None:  # as vLLM: the model's own context length
        try:
            config = json.loads((model / "config.json").read_text())
        except ValueError as e:
            raise ServeError(f"model {args.model}: config.json is not JSON: {e}") from None
        args.max_model_len = int(config.get("max_position_embeddings", DEFAULT_CONTEXT))


def kv_role(args: argparse.Namespace) -> str | None:
    config = args.kv_transfer_config
    if config is None:
        return None
    connector = config.get("kv_connector")
    if connector != "NixlConnector":
        raise ServeError(f"--kv-transfer-config kv_connector {connector!r}: the stand-in models NixlConnector only")
    role = config.get("kv_role")
    if role not in ROLE_OF_KV_ROLE:
        raise ServeError(f"--kv-transfer-config kv_role {role!r} is not one of {', '.join(ROLE_OF_KV_ROLE)}")
    return role


def env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ServeError(f"{name}={text} is not a non-negative number")
    return value


@dataclass(frozen=True)
class Simulation:
    """What the simulated engine takes from the environment (not vLLM flags, so not on the command line)."""

    ttft_ms: float
    itl_ms: float
    kv_transfer_ms: float
    startup_seconds: float  # loading the weights
    kernel_warmup_seconds: float  # a cold autotune (nothing cached)
    kernel_warmup_warm_seconds: float  # a warm one
    graph_capture_seconds: float
    mtp_acceptance: float  # share of MTP draft tokens accepted
    # Latencies that grow with the prompt (0: the constant ones above): prefill time per prompt
    # token (after ttft_ms of overhead), and decode's KV pull per prompt token.
    prefill_us_per_token: float
    kv_transfer_us_per_token: float

    @classmethod
    def from_env(cls) -> Simulation:
        return cls(
            ttft_ms=env_number("GLM_SIM_TTFT_MS", 50),
            itl_ms=env_number("GLM_SIM_ITL_MS", 10),
            kv_transfer_ms=env_number("GLM_SIM_KV_TRANSFER_MS", 20),
            startup_seconds=env_number("GLM_SIM_STARTUP_SECONDS", 2),
            kernel_warmup_seconds=env_number("GLM_SIM_KERNEL_WARMUP_SECONDS", 0),
            kernel_warmup_warm_seconds=env_number("GLM_SIM_KERNEL_WARMUP_WARM_SECONDS", 0),
            graph_capture_seconds=env_number("GLM_SIM_GRAPH_CAPTURE_SECONDS", 0),
            mtp_acceptance=min(env_number("GLM_SIM_MTP_ACCEPTANCE", 0.8), 1.0),
            prefill_us_per_token=env_number("GLM_SIM_PREFILL_US_PER_TOKEN", 0),
            kv_transfer_us_per_token=env_number("GLM_SIM_KV_TRANSFER_US_PER_TOKEN", 0),
        )

    def latency_flags(self) -> list[str]:
        """llm-d-inference-sim's latency flags: its constant TTFT (or KV pull) wins over the per-token
        one, so only one of the two is given."""
        if self.prefill_us_per_token:
            flags = [f"--prefill-overhead={self.ttft_ms:g}ms", f"--prefill-time-per-token={self.prefill_us_per_token:g}us"]
        else:
            flags = [f"--time-to-first-token={self.ttft_ms:g}ms"]
        if self.kv_transfer_us_per_token:
            flags.append(f"--kv-cache-transfer-time-per-token={self.kv_transfer_us_per_token:g}us")
        else:
            flags.append(f"--kv-cache-transfer-latency={self.kv_transfer_ms:g}ms")
        return flags + [f"--inter-token-latency={self.itl_ms:g}ms"]


def listen(host: str, port: int, what: str) -> socket.socket:
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise ServeError(f"cannot bind {what} on {host}:{port}: {e.strerror or e}") from None


def _tool_lines(*cmd: str) -> list[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise ServeError(f"{cmd[0]}: {e.strerror or e}") from None
    if p.returncode != 0:
        raise ServeError(f"{' '.join(cmd)} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[:200]}")
    return p.stdout.splitlines()


def _bdf(text: str) -> str:
    """A PCI address as vLLM's normalize_pci writes it: 4-digit domain, lower case."""
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])", text.strip())
    if not m:
        raise ServeError(f"not a PCI address: {text!r}")
    return f"{int(m.group(1) or '0', 16):04x}:{m.group(2).lower()}"


def nic_per_rank(args: argparse.Namespace) -> list[tuple[int, int, int, str]]:
    """vLLM 0.33.0's per-worker NIC choice (vllm/v1/executor/vllm_net_devices.py, set_worker_gpu_nic_mapping;
    docs/research/vllm-0.33-nic-per-rank.md): with VLLM_GPU_NIC_PCIE_MAPPING (GPU=NIC PCI address pairs)
    and VLLM_NIC_SELECTION_VARS (here UCX_NET_DEVICES:1), each worker's GPU is CUDA_VISIBLE_DEVICES[tp rank +
    local DP rank × TP] (an NVML index under CUDA_DEVICE_ORDER=PCI_BUS_ID); its NIC's RDMA name, with the
    suffix, goes in front of any UCX_NET_DEVICES already set; a GPU without a pair is an error.
    Returns (DP rank, TP rank, GPU, UCX_NET_DEVICES) per worker. The real vLLM reads bus ids from NVML and
    RDMA names from /sys/class/infiniband; the stand-in asks nvidia-smi and ibdev2netdev -v."""
    mapping_text = os.environ.get("VLLM_GPU_NIC_PCIE_MAPPING", "").strip()
    selection = [v.strip() for v in os.environ.get("VLLM_NIC_SELECTION_VARS", "").split(",") if v.strip()]
    if not mapping_text or not selection:
        return []
    pairs = {}
    for pair in mapping_text.split(","):
        gpu, sep, nic = pair.partition("=")
        if not sep:
            raise ServeError(f"VLLM_GPU_NIC_PCIE_MAPPING: {pair!r} is not GPU_BDF=NIC_BDF")
        pairs[_bdf(gpu)] = _bdf(nic)
    bus_ids = {}
    for line in _tool_lines("nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"):
        index, _, bus = line.partition(",")
        bus_ids[int(index)] = _bdf(bus)
    rdma_names = {}
    for line in _tool_lines("ibdev2netdev", "-v"):
        m = re.match(r"^(\S+)\s+(\S+)\s", line)
        if m:
            rdma_names[_bdf(m.group(1))] = m.group(2)
    devices = [int(d) for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    out = []
    for dp in range(args.data_parallel_size):
        for tp in range(args.tensor_parallel_size):
            gpu = devices[tp + dp * args.tensor_parallel_size]
            bus = bus_ids.get(gpu)
            if bus not in pairs:
                raise ServeError(f"RuntimeError: VLLM_GPU_NIC_PCIE_MAPPING has no NIC for GPU {gpu} ({bus})")
            if pairs[bus] not in rdma_names:
                raise ServeError(f"RuntimeError: no RDMA device at {pairs[bus]} (the NIC of GPU {gpu})")
            values = []
            for var in selection:
                name, _, suffix = var.partition(":")
                if name == "UCX_NET_DEVICES":
                    existing = os.environ.get(name, "").strip()
                    first = f"{rdma_names[pairs[bus]]}:{suffix}" if suffix else rdma_names[pairs[bus]]
                    values.append(f"{first},{existing}" if existing else first)
            out.append((dp, tp, gpu, values[0] if values else ""))
    return out


def bind_nixl_side_channel(args: argparse.Namespace) -> list[socket.socket]:
    """One listener per DP rank at base+rank, as the NIXL connector's side channel does."""
    host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "")
    base_text = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "")
    for name, value in (("VLLM_NIXL_SIDE_CHANNEL_HOST", host), ("VLLM_NIXL_SIDE_CHANNEL_PORT", base_text)):
        if not value:
            raise ServeError(f"{name} is not set; NixlConnector needs it with --kv-transfer-config")
    if not base_text.isdigit() or not 1 <= int(base_text) <= 65535 - args.data_parallel_size + 1:
        raise ServeError(f"VLLM_NIXL_SIDE_CHANNEL_PORT={base_text} leaves no room for {args.data_parallel_size} ranks")
    base = int(base_text)
    return [
        listen(host, base + rank, f"NIXL side channel of DP rank {rank}") for rank in range(args.data_parallel_size)
    ]


def simulator_binary() -> Path:
    bundled = Path(__file__).parent / "_bin" / "llm-d-inference-sim"
    if os.access(bundled, os.X_OK):
        return bundled
    fallback = os.environ.get("GLM_SIM_BINARY")
    if fallback and os.access(fallback, os.X_OK):
        return Path(fallback)
    raise ServeError(f"no llm-d-inference-sim: {bundled} is missing and GLM_SIM_BINARY is not an executable")


def free_port() -> int:
    # The simulator listens on every interface, so the port must be free on all of them.
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child: get SIGKILL if the stand-in dies without stopping it (e.g. SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_simulator(binary: Path, args: argparse.Namespace, simulation: Simulation, port: int) -> subprocess.Popen:
    command = [
        str(binary),
        f"--port={port}",
        f"--model={args.model}",
        *simulation.latency_flags(),
        f"--max-num-seqs={args.max_num_seqs}",
        f"--max-model-len={args.max_model_len}",
        # It sizes buffers by (max-num-seqs + this) × max-model-len; the default 1000 would reserve
        # gigabytes per instance at a 1M-token context.
        "--max-waiting-queue-length=64",
        # vLLM's -dp N serves one API port; the simulator's would listen on port, port+1, …
        "--data-parallel-size=1",
        # Otherwise it asks huggingface.co whether the model name is a real model.
        "--force-dummy-tokenizer",
    ]
    if args.served_model_name:
        # Last: the simulator reads the names up to the next "--" flag.
        command += ["--served-model-name", *args.served_model_name]
    # Own session: a Ctrl-C meant for the stand-in must not kill the simulator before the drain.
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)


# --- the running instance ---------------------------------------------------------------------


class Instance:
    def __init__(self, args: argparse.Namespace, role: str, simulation: Simulation, upstream_port: int):
        self.role = role
        self.upstream_port = upstream_port
        self.api_key = os.environ.get("VLLM_API_KEY") or None
        self.shutdown_timeout = args.shutdown_timeout
        self.args = args
        self.simulation = simulation
        self.loaded = False
        self.failed = ""  # why the engine could not start: the process exits 1
        self.ready = False
        # Set from the signal handler without a lock; admit() reads it under the lock.
        self.draining = False
        self.drain_signal = ""
        self._lock = threading.Lock()
        self._in_flight = 0
        self.engine = EngineMetrics(args, role, simulation)
        self.port = args.port
        self.dp = args.data_parallel_size
        self._next_rank = 0
        # What greedy decoding depends on here: the model (its config) and the prompt. Another revision of the
        # same model answers a fixed count the same, as a real one does (canary.py's prompt); a broken engine
        # does not (the faults below).
        # (The test bed's checkpoint stamps its revision into config.json, make-checkpoint; a real one does not.)
        config = json.loads((Path(args.model) / "config.json").read_bytes())
        config.pop("revision", None)
        self.weights = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()

    def next_rank(self) -> int:
        """The DP rank a request goes to: in turn, as vLLM's coordinator spreads concurrent requests."""
        with self._lock:
            rank = self._next_rank
            self._next_rank = (rank + 1) % self.dp
            return rank

    def rank_of(self, header: str | None) -> int:
        """The DP rank a request goes to: the one its X-data-parallel-rank header names (vLLM 0.33.0,
        entrypoints/generate/base/serving.py: not an int, ignored; v1/engine/input_processor.py: out of
        range, refused with ValueError), else the next in turn."""
        try:
            rank = int(header) if header is not None else None
        except ValueError:
            rank = None
        if rank is None:
            return self.next_rank()
        if not 0 <= rank < self.dp:
            raise ValueError(f"data_parallel_rank {rank} is out of range [0, {self.dp}).")
        return rank

    def fault(self) -> str:
        """What the test of a host asked this instance to do wrong (FAULTS_DIR/<port>: "wrong" answers
        greedy requests wrongly, "hang-rank=N" holds every request DP rank N gets); "" when nothing."""
        try:
            return (Path(FAULTS_DIR) / str(self.port)).read_text().strip()
        except OSError:
            return ""

    def admit(self) -> None:
        """Count a request in flight (also while draining: it was accepted before the socket closed)."""
        with self._lock:
            self._in_flight += 1

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def healthy(self) -> bool:
        return self.ready and not self.draining

    def load(self) -> None:
        """The engine's start (startup.py): weights, kernel warmup with its cache, graph capture."""
        s = self.simulation
        try:
            startup.run(self.args, s.startup_seconds, s.kernel_warmup_seconds, s.kernel_warmup_warm_seconds,
                        s.graph_capture_seconds, log, stopping=lambda: self.draining)
        except (OSError, ValueError) as e:  # never serving without its engine
            self.failed = str(e)
            return
        self.loaded = True

    def wait_until_loaded(self, server: ProxyServer) -> None:
        """Listen once the engine has started (load) and the simulator answers /health."""
        threading.Thread(target=self.load, daemon=True).start()
        while not self.draining:
            if self.loaded and self._simulator_healthy():
                server.server_activate()
                self.ready = True
                threading.Thread(target=server.serve_forever, daemon=True).start()
                log(f"glm-sim {self.role}: ready")
                return
            time.sleep(0.1)

    def _simulator_healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()


NIXL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets of vllm:time_to_first_token_seconds (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TTFT = "vllm:time_to_first_token_seconds"
# vLLM binds every engine's histograms at start (vllm/v1/metrics/loggers.py, make_per_engine: metric.labels(...)),
# so they are served at zero before any request; llm-d-inference-sim serves its histogram vectors only once
# observed, and observes inter-token latency only for a request of two tokens or more (its random lengths
# make that a coin toss). These the stand-in serves at zero until the simulator has them (the simulator's
# buckets, common.TPOTBucketsBoundaries).
ZERO_AT_START = {"vllm:inter_token_latency_seconds": (
    "Histogram of inter-token latency in seconds.",
    (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0))}
FIRST_TOKEN = re.compile(rb'"(content|text)":"[^"]')


class EngineMetrics:
    """vLLM 0.33's metric families that llm-d-inference-sim does not have, appended to its /metrics:
    MTP (spec decode) counters derived from the tokens it generated and the configured acceptance,
    NIXL transfer time and failures per KV pull a decode instance made, and, with one API server only,
    the process's resident memory (what vLLM's process collector reports; with several it reports none)."""

    def __init__(self, args: argparse.Namespace, role: str, simulation: Simulation) -> None:
        spec = args.speculative_config or {}
        self.draft_len = int(spec.get("num_speculative_tokens", 0) or 0)
        self.acceptance = simulation.mtp_acceptance
        self.kv_transfer_s = simulation.kv_transfer_ms / 1000
        self.model = (args.served_model_name or [args.model])[0]
        self.role = role
        self.api_servers = args.api_server_count or args.data_parallel_size
        self.simulator_pid: int | None = None
        self._lock = threading.Lock()
        self.transfers = 0
        self.failed = 0
        self.ttft: list[float] = []  # seconds from a request's arrival to its first token

    def kv_pulled(self, ok: bool) -> None:
        with self._lock:
            self.transfers += ok
            self.failed += not ok

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.append(seconds)

    def exposition(self, simulator_metrics: str) -> str:
        """What to append to the simulator's /metrics (``without_ttft`` of it: the stand-in measures
        TTFT itself, from the request's arrival as vLLM does; the simulator's counts only its sleep)."""
        labels = f'engine="0",model_name="{self.model}"'
        with self._lock:
            ttft = list(self.ttft)
        out = [f"# HELP {TTFT} Histogram of time to first token in seconds.\n# TYPE {TTFT} histogram\n"]
        out += [f'{TTFT}_bucket{{{labels},le="{le}"}} {sum(1 for t in ttft if t <= le)}\n' for le in TTFT_BUCKETS]
        out.append(f'{TTFT}_bucket{{{labels},le="+Inf"}} {len(ttft)}\n{TTFT}_sum{{{labels}}} {sum(ttft)}\n'
                   f"{TTFT}_count{{{labels}}} {len(ttft)}\n")
        for family, (text, buckets) in ZERO_AT_START.items():
            if f"{family}_count" not in simulator_metrics:
                out.append(f"# HELP {family} {text}\n# TYPE {family} histogram\n")
                out += [f'{family}_bucket{{{labels},le="{le}"}} 0\n' for le in (*buckets, "+Inf")]
                out.append(f"{family}_sum{{{labels}}} 0.0\n{family}_count{{{labels}}} 0\n")
        if self.draft_len:
            generated = sum(float(line.rsplit(" ", 1)[1]) for line in simulator_metrics.splitlines()
                            if line.startswith("vllm:generation_tokens_total"))
            # Each step drafts draft_len tokens and emits the accepted ones plus one of its own.
            drafts = generated / (1 + self.draft_len * self.acceptance)
            for name, value, text in (
                ("vllm:spec_decode_num_drafts", drafts, "Number of spec decoding drafts."),
                ("vllm:spec_decode_num_draft_tokens", drafts * self.draft_len, "Number of draft tokens."),
                ("vllm:spec_decode_num_accepted_tokens", drafts * self.draft_len * self.acceptance,
                 "Number of accepted tokens."),
            ):
                out.append(f"# HELP {name}_total {text}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {value:.1f}\n")
        if self.role == "decode":
            with self._lock:
                n, failed = self.transfers, self.failed
            name = "vllm:nixl_xfer_time_seconds"
            out.append(f"# HELP {name} Histogram of transfer duration for NIXL KV Cache transfers.\n# TYPE {name} histogram\n")
            for le in NIXL_BUCKETS:
                out.append(f'{name}_bucket{{{labels},le="{le}"}} {n if self.kv_transfer_s <= le else 0}\n')
            out.append(f'{name}_bucket{{{labels},le="+Inf"}} {n}\n{name}_sum{{{labels}}} {n * self.kv_transfer_s}\n'
                       f"{name}_count{{{labels}}} {n}\n")
            out.append("# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.\n"
                       "# TYPE vllm:nixl_num_failed_transfers_total counter\n"
                       f"vllm:nixl_num_failed_transfers_total{{{labels}}} {failed}\n")
        if self.api_servers > 1:
            # vLLM 0.33.0 with more than one API server serves its metrics from Prometheus's multiprocess
            # collector only: no process_* family at all (0 of 439 lines on a real GPU, real-engine/README.md).
            return "".join(out)
        rss = 0
        for pid in (os.getpid(), self.simulator_pid):
            try:
                rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, TypeError, ValueError, IndexError):
                pass
        out.append("# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
                   f"# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {rss}\n")
        return "".join(out)


def without_family(exposition: str, family: str) -> str:
    """A Prometheus text exposition without the lines of one metric family (its HELP, TYPE and samples)."""
    kept = []
    for line in exposition.splitlines():
        words = line.split()
        name = words[2] if line.startswith("# ") and len(words) > 2 else line.split("{", 1)[0].split(" ", 1)[0]
        if name != family and not name.startswith(family + "_"):
            kept.append(line)
    return "\n".join(kept) + "\n"


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog; the default 5 drops connections under a burst

    def __init__(self, address: tuple[str, int]) -> None:
        # Bound now (the port is reserved, a collision fails at once), listening only when loaded.
        super().__init__(address, ProxyHandler, bind_and_activate=False)
        try:
            self.server_bind()
        except OSError:
            self.server_close()
            raise
        self.idle: set[socket.socket] = set()
        self.idle_lock = threading.Lock()

    def stop_accepting(self) -> None:
        """Close the listening socket: new connections are refused. Keep-alive connections stay
        open a little longer (a request arriving on one is answered with Connection: close), so a
        client never sends into a connection this side just closed."""
        if self.instance.ready:
            self.shutdown()
        self.socket.close()

    def close_idle(self) -> None:
        with self.idle_lock:
            for conn in self.idle:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
    instance: Instance


def greedy_request(body: bytes) -> tuple[str, int] | None:
    """(the prompt, the tokens asked for) of a non-streamed request at temperature 0 (greedy
    decoding, which never stops early here), else None."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict) or request.get("temperature") != 0 or request.get("stream"):
        return None
    prompt = request.get("prompt", request.get("messages"))
    tokens = request.get("max_tokens") or request.get("max_completion_tokens") or 16
    if prompt is None or not isinstance(tokens, int) or tokens < 1:
        return None
    return json.dumps(prompt, sort_keys=True), min(tokens, 256)


def greedy_answer(data: bytes, weights: str, greedy: tuple[str, int], wrong: bool) -> bytes:
    """The simulator's answer with vLLM's greedy text: the same for the same weights and prompt (the
    simulator's own is random). With ``wrong``, the answer of a broken engine: other words, HTTP 200."""
    answer = json.loads(data)
    prompt, n = greedy
    usage = answer.get("usage")
    if isinstance(usage, dict):
        usage["completion_tokens"] = n
        usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + n
    for choice in answer.get("choices", []):
        seed = hashlib.sha256(f"{weights}\n{prompt}{chr(10) + 'wrong' if wrong else ''}".encode()).digest()
        text = " " + " ".join(GREEDY_WORDS[seed[i % len(seed)] % len(GREEDY_WORDS)] for i in range(n))
        if "text" in choice:
            choice["text"] = text
        elif isinstance(choice.get("message"), dict):
            choice["message"]["content"] = text.strip()
    return json.dumps(answer).encode()


def kv_flags(body: bytes) -> str:
    try:
        params = json.loads(body).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    params = params if isinstance(params, dict) else {}
    flags = [f"{name}={str(bool(params.get(name))).lower()}" for name in ("do_remote_decode", "do_remote_prefill")]
    return " " + " ".join(flags)


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ProxyServer

    def do_GET(self) -> None:
        self.handle_request()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def handle_one_request(self) -> None:
        with self.server.idle_lock:
            self.server.idle.add(self.connection)
        try:
            super().handle_one_request()
        finally:
            with self.server.idle_lock:
                self.server.idle.discard(self.connection)

    def handle_request(self) -> None:
        with self.server.idle_lock:
            self.server.idle.discard(self.connection)
        instance = self.server.instance
        if instance.draining:
            self.close_connection = True  # answer this one, then let the client reconnect elsewhere
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self.reply(200 if instance.healthy() else 503)
            return
        started = time.monotonic()
        self.arrival = started
        status, note = self.dispatch(instance, path)
        # The P/D router sends the same X-Request-Id to prefill and decode: it pairs the two lines.
        request_id = self.headers.get("X-Request-Id")
        note += f" request_id={request_id}" if request_id else ""
        log(f"glm-sim {instance.role}: {self.command} {self.path} {status}{note} {time.monotonic() - started:.3f}s")

    def dispatch(self, instance: Instance, path: str) -> tuple[int, str]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True  # the unread body would be taken for the next request
            return self.reply(411, {"error": "send Content-Length"}), ""
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        instance.admit()
        try:
            if instance.api_key and path not in OPEN_PATHS and not self.authorized(instance.api_key):
                return self.reply(401, {"error": "Unauthorized"}), " (no valid API key)"
            note = kv_flags(body) if path in GENERATION_PATHS else ""
            if path == "/metrics" and self.command == "GET":
                return self.metrics(instance), note
            try:
                self.first_token_at: float | None = None
                if path in GENERATION_PATHS and self.command == "POST":
                    try:
                        fault, rank = instance.fault(), instance.rank_of(self.headers.get("X-data-parallel-rank"))
                    except ValueError as e:
                        return self.reply(400, {"error": str(e)}), note
                    if fault == f"hang-rank={rank}":  # a DP rank that stopped: /health stays 200
                        while not instance.draining and instance.fault() == fault:
                            time.sleep(0.1)
                        if instance.draining:
                            self.close_connection = True
                            return 499, f"{note} (DP rank {rank} hung)"
                    greedy = greedy_request(body)
                    if greedy is not None:
                        return self.forward(instance.upstream_port, body, rewrite=lambda answer: greedy_answer(
                            answer, instance.weights, greedy, wrong=fault == "wrong")), note + f" rank={rank}"
                status = self.forward(instance.upstream_port, body)
                if path in GENERATION_PATHS and status == 200 and self.first_token_at is not None:
                    instance.engine.first_token(self.first_token_at - self.arrival)
                if "do_remote_prefill=true" in note:
                    instance.engine.kv_pulled(status < 500)
                return status, note
            except (OSError, http.client.HTTPException) as e:
                self.close_connection = True
                return 499, f"{note} (connection lost: {e!r})"
        finally:
            instance.release()

    def metrics(self, instance: Instance) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", instance.upstream_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            upstream = conn.getresponse()
            text = upstream.read().decode()
        except (OSError, http.client.HTTPException) as e:
            return self.reply(502, {"error": f"engine unreachable: {e}"})
        finally:
            conn.close()
        body = (without_family(text, TTFT) + instance.engine.exposition(text)).encode()
        self.send_response_only(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return 200

    def authorized(self, api_key: str) -> bool:
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    def forward(self, upstream_port: int, body: bytes, rewrite=None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", upstream_port)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or self.command in ("POST", "PUT", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            upstream = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            return self.reply(502, {"error": f"engine unreachable: {e}"})
        try:
            if rewrite is not None and upstream.status == 200:
                data = rewrite(upstream.read())
                self.send_response_only(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.first_token_at = time.monotonic()
            else:
                self.relay(upstream)
        finally:
            conn.close()
        return upstream.status

    def relay(self, upstream: http.client.HTTPResponse) -> None:
        """Pass the response on as it arrives: SSE streams chunk by chunk, not buffered."""
        self.send_response_only(upstream.status, upstream.reason)
        for name, value in upstream.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        length = upstream.getheader("Content-Length")
        chunked = length is None and upstream.status not in (204, 304)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        streaming = "text/event-stream" in (upstream.getheader("Content-Type") or "")
        while data := upstream.read1(65536):
            if streaming and self.first_token_at is None and FIRST_TOKEN.search(data):
                self.first_token_at = time.monotonic()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        if not streaming:  # the whole answer at once: its tokens came with it
            self.first_token_at = time.monotonic()

    def reply(self, status: int, payload: dict | None = None) -> int:
        body = json.dumps(payload).encode() if payload is not None else b""
        self.send_response_only(status)
        self.send_header("Date", self.date_time_string())
        if self.close_connection:
            self.send_header("Connection", "close")
        if payload is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return status


# --- lifecycle --------------------------------------------------------------------------------


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve(args: argparse.Namespace) -> int:
    check_devices(args)
    check_model(args)
    role_key = kv_role(args)
    role = ROLE_OF_KV_ROLE[role_key] if role_key else "colocated"
    simulation = Simulation.from_env()
    binary = simulator_binary()
    for dp, tp, gpu, devices in nic_per_rank(args) if role_key else []:
        log(f"glm-sim {role}: DP rank {dp} TP rank {tp} on GPU {gpu}: UCX_NET_DEVICES={devices}")
    # Held open for the process lifetime: a second instance on the same ports fails like vLLM.
    reserved = bind_nixl_side_channel(args) if role_key else []
    if args.data_parallel_rpc_port is not None:
        reserved.append(listen("127.0.0.1", args.data_parallel_rpc_port, "the data-parallel RPC port"))
    host = args.host or "0.0.0.0"
    try:
        server = ProxyServer((host, args.port))
    except OSError as e:
        raise ServeError(f"cannot bind the API server on {host}:{args.port}: {e.strerror or e}") from None

    upstream_port = free_port()
    simulator = start_simulator(binary, args, simulation, upstream_port)
    instance = Instance(args, role, simulation, upstream_port)
    instance.engine.simulator_pid = simulator.pid
    server.instance = instance

    def begin_drain(signum: int, _frame: object) -> None:
        # Only flags: the main loop logs (writing stdout here could re-enter a write in progress).
        instance.drain_signal = instance.drain_signal or signal.Signals(signum).name
        instance.draining = True

    signal.signal(signal.SIGTERM, begin_drain)
    signal.signal(signal.SIGINT, begin_drain)
    threading.Thread(target=instance.wait_until_loaded, args=(server,), daemon=True).start()
    names = ", ".join(args.served_model_name or [args.model])
    log(f"glm-sim {role}: serving {names} on http://{host}:{args.port} "
        f"(llm-d-inference-sim on port {upstream_port}, pid {simulator.pid})")

    try:
        while not instance.draining:
            if simulator.poll() is not None:
                log(f"glm-sim {role}: llm-d-inference-sim exited with code {simulator.returncode}")
                return 1
            if instance.failed:  # the cause, then vllm/v1/engine/utils.py's words
                log(f"glm-sim {role}: {instance.failed}")
                log("RuntimeError: Engine core initialization failed. See root cause above.")
                return 1
            time.sleep(0.1)
        log(f"glm-sim {role}: {instance.drain_signal}, draining (up to {instance.shutdown_timeout}s)")
        server.stop_accepting()
        start = time.monotonic()
        deadline = start + instance.shutdown_timeout
        grace = start + min(KEEPALIVE_GRACE_S, instance.shutdown_timeout)
        while (instance.in_flight() or time.monotonic() < grace) and time.monotonic() < deadline \
                and simulator.poll() is None:
            time.sleep(0.05)
        server.close_idle()
        if simulator.poll() is not None:
            log(f"glm-sim {role}: llm-d-inference-sim exited with code {simulator.returncode} while draining")
            return 1
        left = instance.in_flight()
        log(f"glm-sim {role}: drained" if not left else f"glm-sim {role}: shutdown timeout, aborting {left} requests")
        return 0
    finally:
        stop(simulator)
        server.server_close()
        for sock in reserved:
            sock.close()
