"""`vllm serve` driven over HTTP: which routes a round, a staged round and a commit post, in order."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_sync.vllm.driver import HttpControl

WEIGHTS = ["/start_weight_update", "/update_weights", "/finish_weight_update"]


@pytest.fixture
def server():
    """A stand-in for vLLM's routes on 127.0.0.1: records each POST's path; answers 500 to
    `/update_weights` once `failing` is set."""
    posted: list[str] = []
    failing = threading.Event()

    class Routes(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            posted.append(self.path)
            status = 500 if failing.is_set() and self.path == "/update_weights" else 200
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield HttpControl(f"http://127.0.0.1:{httpd.server_address[1]}", timeout_s=10.0), posted, failing
    httpd.shutdown()
    thread.join(10)


def test_a_staged_round_never_pauses_generation_and_its_commit_pauses_keeping_requests(server):
    control, posted, _ = server
    control.stage({"op": "stage", "payload": ""})
    assert posted == WEIGHTS
    posted.clear()
    control.commit({"op": "commit", "payload": ""})
    assert posted == ["/pause?mode=keep", *WEIGHTS, "/reset_prefix_cache?reset_running_requests=true", "/resume"]
    posted.clear()
    control.update({"op": "run", "payload": ""})
    assert posted == ["/pause?mode=wait&clear_cache=false", *WEIGHTS, "/resume"]


def test_a_commit_the_engine_refuses_still_resumes_generation(server):
    control, posted, failing = server
    failing.set()
    with pytest.raises(RuntimeError, match=r"^vLLM at http://127.0.0.1:\d+: POST /update_weights answered 500: \{\}$"):
        control.commit({"op": "commit", "payload": ""})
    assert posted == ["/pause?mode=keep", "/start_weight_update", "/update_weights", "/resume"]
