"""mergekit_ram.integration.hub: whether the hub answers, known within seconds.

Every endpoint here is on 127.0.0.1: a closed port, a port that accepts
connections and never answers, and a tiny HTTP server.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from huggingface_hub import constants

from mergekit_ram.integration import hub
from mergekit_ram.integration.hub import hub_reachable, is_repo_id, silent_hub


@pytest.fixture
def online(monkeypatch) -> Iterator[None]:
    """HF_HUB_OFFLINE unset (conftest sets it) and no remembered answer."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub._answers.cache_clear()
    yield
    hub._answers.cache_clear()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose connections the kernel accepts and nobody answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


@pytest.fixture
def answering_port() -> Iterator[int]:
    class Answer(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(404)  # any answer will do
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_offline_sends_nothing(monkeypatch):
    sessions = []
    monkeypatch.setattr(hub, "get_session", lambda: sessions.append(1))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_reachable() is False
    assert sessions == []
    assert silent_hub() == "HF_HUB_OFFLINE=1 is set"


def test_closed_port_is_known_at_once(online, monkeypatch):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    start = time.perf_counter()
    assert hub_reachable() is False
    assert time.perf_counter() - start < 2
    seconds = constants.HF_HUB_ETAG_TIMEOUT
    assert silent_hub() == f"the hub at {endpoint} did not answer within {seconds} s"


def test_silent_hub_is_given_up_after_the_timeout(online, monkeypatch, silent_port):
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent_port}")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    start = time.perf_counter()
    assert hub_reachable() is False
    assert 0.9 < time.perf_counter() - start < 5


def test_an_answer_is_asked_once(online, monkeypatch, answering_port):
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{answering_port}")
    assert hub_reachable() is True
    monkeypatch.setattr(hub, "get_session", lambda: None)  # a second request fails
    assert hub_reachable() is True


@pytest.mark.parametrize(
    "path, expected",
    [
        ("models/base", True),
        ("base", True),
        ("/abs/models/base", False),
        ("./models/base", False),
        ("../base", False),
        ("~/base", False),
    ],
)
def test_is_repo_id(path, expected):
    assert is_repo_id(path) is expected
