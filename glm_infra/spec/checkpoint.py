"""The facts of a checkpoint that capacity planning needs, read from the checkpoint itself: its
``config.json`` and the header of every ``*.safetensors`` file (8 bytes of little-endian header length,
then a JSON header naming each tensor's dtype, shape and byte range). Only those bytes are read, with
HTTP Range requests against the hub (``{endpoint}/{repo}/resolve/{revision}/{file}``, as HF_ENDPOINT
names it, Bearer token when the stack has one) or the mirror (``{mirrorUrl}/{revision}/{file}``), or
from staged files on disk — never the ~465 GB of weights.

Plain ``urllib``: ``huggingface_hub`` is not a dependency of the library (only the hosts' runtime and
the tests pin it), and two ranged GETs per file are all this needs.

The result is a *facts snapshot* (JSON): the config and, per file, the bytes of each tensor class.
``glm-infra capacity fetch STACK`` writes it; ``plan`` / ``validate`` read it offline.

Beside the snapshots, ``checkpoints/<owner>--<name>/`` may hold the checkpoint's own ``config.json``
and ``hf_quant_config.json`` as a published package ships them, with ``SOURCE.json`` (package, version,
wheel and its sha256, the path in the wheel, each file's sha256, licence): ``load_real_config`` checks
every sha256 before reading. They give the config facts when the snapshot is synthetic.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER = 100_000_000
SNAPSHOT_FORMAT = 1

# Tensor classes: what expert parallelism divides (routed experts) and what every rank holds.
CLASSES = ("routed", "attention", "dense_mlp", "shared_experts", "embeddings", "mtp", "other")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class CheckpointError(Exception):
    pass


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def parse_header(prefix: bytes, read: Callable[[int, int], bytes], where: str) -> list[Tensor]:
    """The tensors of one safetensors file, given its first 8 bytes and a reader of byte ranges."""
    if len(prefix) < 8:
        raise CheckpointError(f"{where}: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n <= 0 or n > MAX_HEADER:
        raise CheckpointError(f"{where}: header length {n} is not a safetensors header's")
    raw = read(8, 8 + n - 1)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: header is not JSON ({e})") from None
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = t["data_offsets"]
            out.append(Tensor(name, t["dtype"], tuple(t["shape"]), int(end) - int(start)))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: tensor {name!r} has no dtype/shape/data_offsets") from None
    return out


def classify(name: str, num_hidden_layers: int) -> str:
    """The class of a tensor of the DeepSeek-V3 / GLM-5 layout: ``mlp.experts.N.*`` are routed
    experts (in the MTP layers too: EP divides them alike); layers ≥ num_hidden_layers are the MTP
    layers; ``shared_experts``, ``self_attn`` (MLA and the DSA indexer), the dense MLP of the first
    layers, the embeddings and lm_head; the rest (norms, router gates) ``other``."""
    if re.search(r"\.mlp\.experts\.\d+\.", name):
        return "routed"
    m = _LAYER.search(name)
    if m and int(m.group(1)) >= num_hidden_layers:
        return "mtp"
    if ".shared_experts." in name:
        return "shared_experts"
    if ".self_attn." in name:
        return "attention"
    if "embed_tokens" in name or name.startswith("lm_head") or ".lm_head." in name:
        return "embeddings"
    if m and ".mlp." in name and ".mlp.gate." not in name:
        return "dense_mlp"
    return "other"


def summarise(tensors: list[Tensor], num_hidden_layers: int) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for t in tensors:
        c = out.setdefault(classify(t.name, num_hidden_layers), {"tensors": 0, "bytes": 0})
        c["tensors"] += 1
        c["bytes"] += t.nbytes
    return out


# --- where the bytes come from --------------------------------------------------------------------


class Source:
    """Reads byte ranges and small files of one checkpoint."""

    description: str

    def read_file(self, name: str) -> bytes:
        raise NotImplementedError

    def read_range(self, name: str, start: int, end: int) -> bytes:  # inclusive end, like HTTP
        raise NotImplementedError


class LocalSource(Source):
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.description = f"staged files in {self.folder}"

    def read_file(self, name: str) -> bytes:
        try:
            return (self.folder / name).read_bytes()
        except OSError as e:
            raise CheckpointError(f"{self.folder / name}: {e.strerror}") from None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        try:
            with open(self.folder / name, "rb") as f:
                f.seek(start)
                return f.read(end - start + 1)
        except OSError as e:
            raise CheckpointError(f"{self.folder / name}: {e.strerror}") from None


class HttpSource(Source):
    """The hub (``base`` = ``{endpoint}/{repo}/resolve/{revision}``) or a mirror (``{mirrorUrl}/{revision}``)."""

    def __init__(self, base: str, token: str | None = None, timeout: float = 60) -> None:
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.description = self.base
        self.requests = 0

    def _get(self, name: str, headers: dict[str, str]) -> tuple[int, Any]:
        url = f"{self.base}/{urllib.parse.quote(name)}"
        if self.token:
            headers = {**headers, "Authorization": f"Bearer {self.token}"}
        self.requests += 1
        try:
            r = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise CheckpointError(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            raise CheckpointError(f"{url}: {getattr(e, 'reason', e)}") from None
        return r.status, r

    def read_file(self, name: str) -> bytes:
        _, r = self._get(name, {})
        with r:
            return r.read()

    def read_range(self, name: str, start: int, end: int) -> bytes:
        status, r = self._get(name, {"Range": f"bytes={start}-{end}"})
        with r:
            if status == 206:
                data = r.read(end - start + 1)
            elif status == 200 and end < MAX_HEADER + 8:
                # A server that ignores a bounded range (glm-infra's own relay takes only "bytes=A-")
                # sends the whole file: read up to the header's end, then close the connection.
                data = r.read(end + 1)[start:]
            else:
                raise CheckpointError(f"{self.base}/{name}: answered {status} to a Range request")
        if len(data) != end - start + 1:
            raise CheckpointError(f"{self.base}/{name}: {len(data)} bytes for range {start}-{end}")
        return data


def weight_files(src: Source) -> list[str]:
    """The safetensors files: the index's weight map (a sharded checkpoint), else model.safetensors."""
    try:
        index = json.loads(src.read_file("model.safetensors.index.json"))
    except CheckpointError:
        return ["model.safetensors"]
    except ValueError as e:
        raise CheckpointError(f"{src.description}: model.safetensors.index.json is not JSON ({e})") from None
    return sorted(set(index.get("weight_map", {}).values()))


def read_snapshot(src: Source, repo: str, revision: str) -> dict[str, Any]:
    """config.json and the per-file tensor summaries of a checkpoint, as a facts snapshot."""
    try:
        config = json.loads(src.read_file("config.json"))
    except ValueError as e:
        raise CheckpointError(f"{src.description}: config.json is not JSON ({e})") from None
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int):
        raise CheckpointError(f"{src.description}: config.json has no num_hidden_layers")
    files = {}
    for name in weight_files(src):
        where = f"{src.description}/{name}"
        tensors = parse_header(src.read_range(name, 0, 7), lambda a, b, n=name: src.read_range(n, a, b), where)
        files[name] = summarise(tensors, layers)
    return {"format": SNAPSHOT_FORMAT, "repo": repo, "revision": revision, "source": src.description,
            "config": config, "files": files}


def class_bytes(snapshot: dict[str, Any]) -> dict[str, int]:
    """Bytes per tensor class over every file of a snapshot."""
    out = dict.fromkeys(CLASSES, 0)
    for summary in snapshot["files"].values():
        for cls, v in summary.items():
            out[cls] = out.get(cls, 0) + int(v["bytes"])
    return out


def snapshot_name(repo: str) -> str:
    """File name of a repository's snapshot: ``nvidia/GLM-5.2-NVFP4`` → ``nvidia--GLM-5.2-NVFP4.json``."""
    return repo.replace("/", "--") + ".json"


# Snapshots shipped with the library (so a Cluster built by another program finds them too).
SNAPSHOT_DIR = Path(__file__).resolve().parent / "checkpoints"


def load_snapshot(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT or "config" not in data:
        raise CheckpointError(f"{path}: not a checkpoint facts snapshot (format {SNAPSHOT_FORMAT})")
    return data


def is_synthetic(snapshot: dict[str, Any]) -> bool:
    """A snapshot not read from the checkpoint (testbed/glm5_checkpoint.py's generated headers)."""
    return snapshot.get("revision") == "synthetic" or str(snapshot.get("source", "")).startswith("SYNTHETIC")


# --- the checkpoint's own config files, copied from a published source ---------------------------------

# config.json and hf_quant_config.json of a repository, byte for byte as a published package ships them,
# in checkpoints/<owner>--<name>/ with SOURCE.json saying which package, version, file and licence and
# each file's sha256 (checked before a byte is read: a file edited by hand is not the checkpoint's).
# config.json keys capacity reads (a stack gives any of them in capacity.modelFacts).
FACT_KEYS = ("num_hidden_layers", "num_nextn_predict_layers", "kv_lora_rank", "qk_rope_head_dim",
             "index_head_dim", "max_position_embeddings")
REAL_FILES = ("config.json", "hf_quant_config.json")


@dataclass(frozen=True)
class RealConfig:
    folder: Path
    config: dict[str, Any]
    quant: dict[str, Any] | None  # hf_quant_config.json, when the source has one
    source: dict[str, Any]  # SOURCE.json

    @property
    def origin(self) -> str:
        s = self.source
        return f"{s['package']} {s['version']} ({s['wheel']}, sha256 {s['wheel_sha256'][:12]}…)"


def real_config_dir(repo: str) -> Path:
    return SNAPSHOT_DIR / repo.replace("/", "--")


def load_real_config(folder: Path) -> RealConfig:
    """The config files in ``folder``, each checked against the sha256 its SOURCE.json records."""
    folder = Path(folder)
    src_path = folder / "SOURCE.json"
    try:
        source = json.loads(src_path.read_text())
        listed = source["files"]
        for key in ("package", "version", "wheel", "wheel_sha256", "license"):
            if not isinstance(source[key], str):
                raise KeyError(key)
    except OSError as e:
        raise CheckpointError(f"{src_path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{src_path}: not a provenance record (package, version, wheel, wheel_sha256, "
                              f"license, files): {e}") from None
    if not isinstance(listed, dict) or "config.json" not in listed:
        raise CheckpointError(f"{src_path}: lists no config.json")
    got: dict[str, dict[str, Any]] = {}
    for name in REAL_FILES:
        if name not in listed:
            continue
        path = folder / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: {e.strerror}") from None
        want = listed[name].get("sha256") if isinstance(listed[name], dict) else None
        digest = hashlib.sha256(data).hexdigest()
        if digest != want:
            raise CheckpointError(f"{path}: sha256 {digest} is not the {want} that {src_path.name} records for "
                                  f"{listed[name].get('path_in_wheel', name) if isinstance(listed[name], dict) else name} "
                                  f"of {source['package']} {source['version']}: the file is not the published one "
                                  "(restore it, or record where the new one came from)")
        try:
            got[name] = json.loads(data)
        except ValueError as e:
            raise CheckpointError(f"{path}: not JSON ({e})") from None
    return RealConfig(folder, got["config.json"], got.get("hf_quant_config.json"), source)


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
