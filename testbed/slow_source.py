"""A model mirror for the relay tests: serves a directory (single-range requests) at a fixed byte rate
per response, so a staging is slow enough to interrupt. Logs every GET on stderr."""

from __future__ import annotations

import argparse
import http.server
import os
import socketserver
import time
import urllib.parse


class Handler(http.server.SimpleHTTPRequestHandler):
    rate = 1 << 20  # bytes per second per response

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        path = self.translate_path(urllib.parse.urlparse(self.path).path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        rng = self.headers.get("Range", "")
        start = int(rng[6:-1]) if rng.startswith("bytes=") and rng.endswith("-") else 0
        if start >= size > 0:
            self.send_error(416)
            return
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(size - start))
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(start)
            step = max(self.rate // 20, 1)
            while chunk := f.read(step):
                self.wfile.write(chunk)
                time.sleep(len(chunk) / self.rate)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--rate", type=int, default=1 << 20)
    a = ap.parse_args()
    host, _, port = a.bind.rpartition(":")
    handler = type("H", (Handler,), {"rate": a.rate})
    with Server((host, int(port)), lambda *x, **k: handler(*x, directory=a.dir, **k)) as s:
        s.serve_forever()


if __name__ == "__main__":
    main()
