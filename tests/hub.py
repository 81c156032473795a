"""A local stand-in for the Hugging Face Hub's HTTP API, so tests can use hub ids.

It serves `{"owner/name": {revision: folder}}` on the routes huggingface_hub and
transformers download through (model info, tree listing, HEAD/GET of resolve
URLs) and answers errors with the hub's `X-Error-Code` headers, so the client
raises its real RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError or
EntryNotFoundError. huggingface_hub reads HF_ENDPOINT once, at import: run the
code under test in a subprocess with `Hub.environ()`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Collection, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

# /api/models/{repo}[/revision|tree/{rev}[/{path}]] and /{repo}/resolve/{rev}/{path}
_API = re.compile(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/(resolve)/([^/]+)/(.+)")


def fake_sha(repo: str, revision: str) -> str:
    """The stable 40-hex commit id served for `repo` at `revision`."""
    return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()


def hub_environ(endpoint: str, cache: str | Path) -> dict[str, str]:
    """Variables that point a new process's huggingface_hub at `endpoint`:
    online, with its cache under `cache`, no developer token, no telemetry."""
    return {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(cache),
        "HF_HUB_CACHE": str(Path(cache) / "hub"),
        "HF_HUB_OFFLINE": "0",  # the test session itself sets HF_HUB_OFFLINE=1
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",  # never send a developer's token
        "HF_HUB_DISABLE_TELEMETRY": "1",  # else it also GETs /api/agent-harnesses
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


class Hub(ThreadingHTTPServer):
    """Serves `repos` on 127.0.0.1, on a port the OS picks; a context manager.

    Each revision also answers to its commit sha, as snapshot_download asks for
    the tree by sha. A repo in `gated` shows its metadata but refuses downloads
    with 401 GatedRepo, as the hub does without a token.
    """

    daemon_threads = True

    def __init__(self, repos: Mapping[str, Mapping], gated: Collection[str] = ()):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.gated = set(gated)
        self.revisions: dict[str, dict[str, tuple[str, Path]]] = {}
        for repo, revs in repos.items():
            for rev, folder in revs.items():
                sha = fake_sha(repo, rev)
                named = self.revisions.setdefault(repo, {})
                named[rev] = named[sha] = (sha, Path(folder))
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def environ(self, cache: str | Path) -> dict[str, str]:
        return hub_environ(self.url, cache)

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


def _blob(path: Path) -> dict[str, object]:
    """A file's size and git blob id, as the tree API lists them."""
    data = path.read_bytes()
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return {"size": len(data), "oid": oid}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Hub

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        hub, url = self.server, urlsplit(self.path)
        match = _API.fullmatch(url.path) or _RESOLVE.fullmatch(url.path)
        if match is None:
            return self._reply(404, {"error": "Sorry, we can't find the page"})
        repo, kind, rev, sub = match.groups()
        rev, sub = unquote(rev or "main"), unquote(sub or "").strip("/")
        if repo not in hub.revisions:
            return self._error(404, "RepoNotFound", "Repository not found")
        if kind == "resolve" and repo in hub.gated:
            return self._error(401, "GatedRepo", f"Access to {repo} is restricted.")
        if rev not in hub.revisions[repo]:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        sha, folder = hub.revisions[repo][rev]
        files = {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}
        if kind == "resolve" and sub in files:
            data = files[sub].read_bytes()
            # sha256, the hub's ETag for LFS files: a local_dir download checks it
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            return self._reply(200, data, {"X-Repo-Commit": sha, "ETag": etag})
        if kind == "tree" and not sub:  # a model folder is flat
            tree = [{"type": "file", "path": n, **_blob(p)} for n, p in files.items()]
            return self._reply(200, tree)
        if kind in (None, "revision"):
            siblings = [{"rfilename": name} for name in files]
            gated = "manual" if repo in hub.gated else False
            info = {"id": repo, "sha": sha, "private": False, "gated": gated}
            return self._reply(200, info | {"siblings": siblings})
        self._error(404, "EntryNotFound", "Entry not found", sha)

    def _error(self, status: int, code: str, message: str, sha: str = "") -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        if sha:  # lets the client cache that the file is missing at this commit
            headers["X-Repo-Commit"] = sha
        self._reply(status, {"error": message}, headers)

    def _reply(self, status: int, body: object, headers: dict | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "GET":  # HEAD: the same headers, no body
            self.wfile.write(data)
