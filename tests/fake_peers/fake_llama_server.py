"""A fake ``llama-server`` for the peer tests: the command line and endpoints the bench uses.

It records its command line and every ``/completion`` body in the JSON-lines file named by
``FAKE_PEER_RECORD``, answers ``/health`` with 503 for its first two polls (loading), then
200, and generates ``n_predict`` tokens after a short, proportional pause. With
``FAKE_PEER_FAIL=1`` it exits at once with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_lock = threading.Lock()
_arrived = threading.Condition()
_state: dict[str, Any] = {"health_polls": 0, "in_flight": 0, "max_in_flight": 0}
SLOTS = 1


def record(entry: dict[str, Any]) -> None:
    with _lock, open(os.environ["FAKE_PEER_RECORD"], "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            with _lock:
                _state["health_polls"] += 1
                ready = _state["health_polls"] > 2
            self._send(200 if ready else 503, {"status": "ok" if ready else "loading"})
        elif self.path == "/props":
            self._send(200, {"build_info": "b0-fake"})
        else:
            self._send(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = (
            self.path == "/completion"
            and all(isinstance(t, int) for t in body["prompt"])
            and body["ignore_eos"] is True
            and body["cache_prompt"] is False
            and body["temperature"] == 0
        )
        if not ok:
            self._send(400, {"error": "unexpected request"})
            return
        with _arrived:
            _state["in_flight"] += 1
            _state["max_in_flight"] = max(_state["max_in_flight"], _state["in_flight"])
            _state["last_arrival"] = time.monotonic()
            _arrived.notify_all()
            # Hold every request until all slots are busy, or until no request came for a
            # while (a smaller batch): so max_in_flight shows whether they came all at once.
            while _state["in_flight"] < SLOTS and time.monotonic() - _state["last_arrival"] < 1:
                _arrived.wait(0.05)
        time.sleep(0.01 * body["n_predict"])
        with _arrived:
            _state["in_flight"] -= 1
            record({"completion": [len(body["prompt"]), body["n_predict"]]})
            record({"max_in_flight": _state["max_in_flight"]})
        self._send(200, {"content": "", "tokens_predicted": body["n_predict"]})


def main() -> int:
    if os.environ.get("FAKE_PEER_FAIL"):
        print("fake llama-server: failing on purpose", file=sys.stderr)
        return 3
    parser = argparse.ArgumentParser()
    for flag in ("-m", "--host", "--port", "-np", "-c", "-t", "-tb"):
        parser.add_argument(flag)
    parser.add_argument("--cont-batching", action="store_true")
    args = parser.parse_args()
    record({"argv": sys.argv[1:]})
    global SLOTS
    SLOTS = int(args.np)
    server = ThreadingHTTPServer((args.host, int(args.port)), Handler)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
