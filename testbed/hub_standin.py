"""A loopback stand-in for the Hugging Face Hub: just the endpoints `huggingface_hub` uses to list a
model at a revision and to download it (`hf download --local-dir`), over a checkpoint written by
testbed/standins/make-checkpoint. The real `huggingface_hub` (pinned in the test extras) talks to it
through HF_ENDPOINT, so weights.py's Hugging Face source path runs the real library and CLI.

    python hub_standin.py --dir SRC --repo ORG/NAME --bind 127.0.0.1:PORT [--token T]

SRC/<commit>/ holds the files and manifest.json; "main" resolves to the only commit. With --token,
every request without `Authorization: Bearer T` gets 401, like a gated repository. A Range request
(bytes=A- or bytes=A-B) gets 206 and that slice, as the hub's resolve URLs do.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import os
import re
import sys
import threading
import urllib.parse


def git_blob_id(path: str) -> str:
    """The git object id of the file's blob (for an LFS file the hub gives its pointer's; any stable
    id does here)."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")  # like the hub: big binaries in LFS, small JSON in git


LOG_LOCK = threading.Lock()


class Hub(http.server.BaseHTTPRequestHandler):
    src: str
    repo: str
    token: str | None

    def log_message(self, fmt: str, *args) -> None:  # one line per request, for the tests to count
        # One write of the whole line, under a lock: print() from the server's threads writes the text
        # and the newline apart, and two requests' lines ran together (seen: 8 lines for 9 downloads).
        with LOG_LOCK:
            sys.stdout.write(f'"{self.command} {self.path}" {args[1] if len(args) > 1 else ""}\n')
            sys.stdout.flush()

    # --- what the hub knows --------------------------------------------------------------------

    def commit(self, revision: str) -> str | None:
        commits = sorted(d for d in os.listdir(self.src) if re.fullmatch(r"[0-9a-f]{40}", d))
        if revision == "main" and len(commits) == 1:
            return commits[0]
        return revision if revision in commits else None

    def files(self, commit: str) -> list[dict]:
        with open(os.path.join(self.src, commit, "manifest.json")) as f:
            return json.load(f)["files"]

    # --- responses -----------------------------------------------------------------------------

    def reply_json(self, body: object, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def error(self, status: int, code: str, message: str) -> None:
        self.reply_json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message})

    def authorized(self) -> bool:
        if self.token and self.headers.get("Authorization") != f"Bearer {self.token}":
            self.error(401, "GatedRepo", f"Access to model {self.repo} is restricted.")
            return False
        return True

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        if not self.authorized():
            return
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        api = re.fullmatch(rf"/api/models/{re.escape(self.repo)}/(revision|tree)/([^/]+)/?", path)
        resolve = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/([^/]+)/(.+)", path)
        if api:
            commit = self.commit(api.group(2))
            if commit is None:
                return self.error(404, "RevisionNotFound", f"Invalid rev id: {api.group(2)}")
            files = self.files(commit)
            blob = {e["path"]: git_blob_id(os.path.join(self.src, commit, e["path"])) for e in files}
            if api.group(1) == "revision":
                return self.reply_json({"id": self.repo, "modelId": self.repo, "sha": commit, "private": False,
                                        "siblings": [{"rfilename": e["path"], "size": e["size"], "blobId": blob[e["path"]],
                                                      **({"lfs": {"sha256": e["sha256"], "size": e["size"],
                                                                  "pointerSize": 134}} if is_lfs(e["path"]) else {})}
                                                     for e in files]})
            return self.reply_json([{"type": "file", "path": e["path"], "size": e["size"], "oid": blob[e["path"]],
                                     **({"lfs": {"oid": e["sha256"], "size": e["size"], "pointerSize": 134}}
                                        if is_lfs(e["path"]) else {})}
                                    for e in files])
        if resolve:
            commit = self.commit(resolve.group(1))
            entry = next((e for e in self.files(commit) if e["path"] == resolve.group(2)), None) if commit else None
            if entry is None:
                return self.error(404, "EntryNotFound", f"{resolve.group(2)} not found at {resolve.group(1)}")
            path = os.path.join(self.src, commit, entry["path"])
            return self.send_file(path, commit, entry["sha256"] if is_lfs(entry["path"]) else git_blob_id(path))
        self.error(404, "RepoNotFound", f"no route for {path}")

    def send_file(self, path: str, commit: str, etag: str) -> None:
        size = os.path.getsize(path)
        start, end = 0, size - 1
        # Range: bytes=A- (hf's resume) or bytes=A-B (a safetensors header read): 206 with that slice.
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        ranged = bool(m) and int(m.group(1)) < size and (int(m.group(1)) > 0 or bool(m.group(2)))
        if ranged:
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        self.send_response(206 if ranged else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{etag}"')  # the hub's: sha256 for LFS files, the git blob id otherwise
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left > 0 and (chunk := f.read(min(1 << 20, left))):
                self.wfile.write(chunk)
                left -= len(chunk)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--token")
    args = ap.parse_args()
    host, port = args.bind.rsplit(":", 1)
    handler = type("Handler", (Hub,), {"src": args.dir, "repo": args.repo, "token": args.token})
    http.server.ThreadingHTTPServer((host, int(port)), handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
