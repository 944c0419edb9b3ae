"""A downstream service to try forwards with: prints every request posted to it, answers 200.

    python3 bin/sink.py [PORT]      (default 9000, on 127.0.0.1)

Standard library only. Each request is printed as its method, path and
Idempotency-Key, then its body; Ctrl-C stops it.
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(BaseHTTPRequestHandler):
    """Print what is posted and say it was received."""

    def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        key = self.headers.get("Idempotency-Key", "-")
        print(f"{self.command} {self.path} Idempotency-Key: {key}", flush=True)
        print(body.decode("utf-8", "replace"), flush=True)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "16")
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}\n')

    def log_message(self, format: str, *args: object) -> None:
        pass  # the lines above say it all


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 9000
    server = ThreadingHTTPServer(("127.0.0.1", port), Sink)
    print(
        f"listening on http://127.0.0.1:{port}, printing what is posted (Ctrl-C stops it)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
