"""The HTTP side of the fake Hub (tests/hub_server.py): the request handler and a router with one method
per endpoint the real `huggingface_hub` client calls (listed in tests/hub_server.py's docstring)."""

from __future__ import annotations

import hashlib
import json
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tests.hub_server import (
    DEFAULT_GITATTRIBUTES,
    REPO_TYPES,
    URL_PREFIX,
    FakeHub,
    HubError,
    Repo,
    RequestRecord,
    StoredFile,
    git_blob_oid,
    lfs_pointer,
    now_iso,
    truthy,
)
from tests.hub_uploads import UploadRoutes


class RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: an answer's headers and body go out as separate writes, and the second waited for the client's
    # delayed ACK (40 ms) on a kept-alive connection: 1.7 s of a push test's 2.3 s
    disable_nagle_algorithm = True
    fake_hub: FakeHub  # set by subclass in FakeHub.start()

    def log_message(self, format: str, *args: Any) -> None:  # silence stderr
        pass

    # -- plumbing --------------------------------------------------------------

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size_line = self.rfile.readline().strip()
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after chunk
            return b"".join(chunks)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(
        self, status: int, body: Any = None, headers: dict | None = None, content_type: str | None = None
    ) -> None:
        if isinstance(body, (bytes, bytearray)):
            data = bytes(body)
            content_type = content_type or "application/octet-stream"
        elif body is None:
            data = b""
        else:
            data = json.dumps(body).encode()
            content_type = content_type or "application/json; charset=utf-8"
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)
        self._status = status

    def _handle(self) -> None:
        hub = self.fake_hub
        body = self._read_body()
        rec = RequestRecord(self.command, self.path, {k: v for k, v in self.headers.items()}, body)
        with hub._lock:
            hub.requests.append(rec)
            auth = self.headers.get("Authorization")
            if auth is not None:
                hub.auth_headers.append(auth)
        self._status = 0
        try:
            Router(self, hub, body).dispatch()
        except HubError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send(e.status, {"error": e.message, **e.extra}, headers)
        except Exception as e:  # a bug in the fake: report it as a 4xx (5xx would make the client retry)
            import traceback

            with hub._lock:
                hub.errors.append(traceback.format_exc())
            self._send(418, {"error": f"fake hub internal error: {e!r}"})
        rec.status = self._status

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _handle


class Router(UploadRoutes):
    """One request: authorisation, dispatch to the endpoint's method, the repository and read endpoints
    (the upload endpoints: tests/hub_uploads.py)."""

    def __init__(self, h: RequestHandler, hub: FakeHub, body: bytes) -> None:
        self.h, self.hub, self.body = h, hub, body
        parts = urlsplit(h.path)
        self.raw_path = parts.path
        self.query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        # raw segments: keep %2F inside a segment (quoted revisions / branch names) until we unquote it
        self.segs = [s for s in self.raw_path.split("/") if s != ""]

    # -- auth ------------------------------------------------------------------

    def _token(self) -> str | None:
        auth = self.h.headers.get("Authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

    def _authorized(self) -> bool:
        return self.hub.token is None or self._token() == self.hub.token

    def require_write(self) -> None:
        if not self.hub.require_auth_for_write:
            return
        tok = self._token()
        if tok is None:
            raise HubError(401, "Unauthorized: missing Authorization header")
        if tok != self.hub.token:
            raise HubError(401, "Invalid credentials in Authorization header")

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as e:
            raise HubError(400, f"Invalid JSON body: {e}") from e

    def get_repo(self, repo_type: str, repo_id: str, write: bool = False) -> Repo:
        if write:
            self.require_write()
        repo = self.hub._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._authorized()):
            raise HubError(404 if repo is None else 401, "Repository not found", "RepoNotFound")
        return repo

    # -- dispatch --------------------------------------------------------------

    def dispatch(self) -> None:
        m, s = self.h.command, self.segs
        with self.hub._lock:
            if s[:1] == ["api"]:
                return self.api(m, s[1:])
            if s[:1] == ["__lfs__"]:
                return self.lfs_put(m, s[1:])
            # git-lfs endpoints: /{prefix}{ns}/{name}.git/info/lfs/objects/{batch|verify}
            for i, seg in enumerate(s):
                if seg.endswith(".git") and s[i + 1 : i + 4] == ["info", "lfs", "objects"]:
                    repo_type, rid = self._repo_from_prefix(s[:i] + [seg[: -len(".git")]])
                    return self.lfs_api(m, repo_type, rid, s[i + 4 :])
            if len(s) >= 5 and s[2] == "resolve" and m in ("GET", "HEAD"):  # a model repo's file: /{repo}/resolve/..
                return self.resolve(f"{unquote(s[0])}/{unquote(s[1])}", unquote(s[3]), "/".join(map(unquote, s[4:])))
        raise HubError(404, f"fake hub: no route for {m} {self.raw_path}")

    @staticmethod
    def _repo_from_prefix(segs: list[str]) -> tuple[str, str]:
        if len(segs) == 3 and segs[0] in REPO_TYPES:
            return REPO_TYPES[segs[0]], f"{segs[1]}/{segs[2]}"
        if len(segs) == 2:
            return "model", f"{segs[0]}/{segs[1]}"
        raise HubError(404, "Repository not found", "RepoNotFound")

    def api(self, m: str, s: list[str]) -> None:
        if s == ["repos", "create"] and m == "POST":
            return self.create_repo()
        if s == ["validate-yaml"] and m == "POST":
            return self.h._send(200, {"errors": [], "warnings": []})
        if len(s) >= 3 and s[0] in REPO_TYPES:
            repo_type, rid, rest = REPO_TYPES[s[0]], f"{unquote(s[1])}/{unquote(s[2])}", s[3:]
            action = rest[0] if rest else None
            args = [unquote(x) for x in rest[1:]]
            if action is None and m == "GET":
                return self.repo_info(repo_type, rid, None)
            if action == "revision" and m == "GET":
                return self.repo_info(repo_type, rid, "/".join(args))
            if action == "branch" and m == "POST":
                return self.branch(repo_type, rid, "/".join(args))
            if action == "tree" and m == "GET":
                return self.tree(repo_type, rid, args[0] if args else "main", "/".join(args[1:]))
            if action == "preupload" and m == "POST":
                return self.preupload(repo_type, rid, "/".join(args))
            if action == "commit" and m == "POST":
                return self.commit(repo_type, rid, "/".join(args))
        raise HubError(404, f"fake hub: no API route for {m} /api/{'/'.join(s)}")

    # -- repos -----------------------------------------------------------------

    def create_repo(self) -> None:
        self.require_write()
        p = self.json()
        repo_type = p.get("type") or "model"
        if repo_type not in URL_PREFIX:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        name, org = p.get("name"), p.get("organization") or self.hub.user
        if not name:
            raise HubError(400, "Missing repo name")
        rid = f"{org}/{name}"
        url = f"{self.hub.url}/{URL_PREFIX[repo_type]}{rid}"
        if (repo_type, rid) in self.hub._repos:
            raise HubError(409, "You already created this repo", extra={"url": url})
        visibility = p.get("visibility") or ("private" if p.get("private") else "public")
        repo = Repo(repo_id=rid, repo_type=repo_type, private=visibility == "private", created_at=now_iso())
        repo.branches["main"] = None
        repo.last_modified = repo.created_at
        self.hub._repos[(repo_type, rid)] = repo
        if self.hub.initial_commit:
            data = DEFAULT_GITATTRIBUTES.encode()
            f = StoredFile(".gitattributes", self.hub._store(data), len(data), False, git_blob_oid(data))
            self.hub._make_commit(repo, ("branch", "main"), "initial commit", "", {f.path: f}, [f.path], [])
        self.h._send(200, {"url": url, "name": rid, "id": self.hub._new_id(rid)})

    def repo_info(self, repo_type: str, rid: str, revision: str | None) -> None:
        repo = self.get_repo(repo_type, rid)
        head, tree = self.hub._tree(repo, revision)
        blobs = truthy(self.query.get("blobs"))
        siblings = []
        for f in sorted(tree.values(), key=lambda f: f.path):
            sib: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sib.update(size=f.size, blobId=f.git_oid)
                if f.lfs:
                    sib["lfs"] = {
                        "size": f.size,
                        "sha256": f.sha256,
                        "pointerSize": len(lfs_pointer(f.sha256, f.size)),
                    }
            siblings.append(sib)
        info = {
            "_id": hashlib.sha1(repo.key.encode()).hexdigest()[:24],
            "id": rid,
            "author": rid.split("/")[0],
            "sha": head,
            "lastModified": repo.last_modified,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        if repo_type == "model":
            info["modelId"] = rid
        self.h._send(200, info)

    def tree(self, repo_type: str, rid: str, revision: str, under: str) -> None:
        """list_repo_tree: every file of `revision` (under the folder `under`), in one page; no folder entries."""
        repo = self.get_repo(repo_type, rid)
        _, tree = self.hub._tree(repo, revision)
        prefix = f"{under.strip('/')}/" if under else ""
        entries = []
        for f in sorted(tree.values(), key=lambda f: f.path):
            if f.path.startswith(prefix) and (truthy(self.query.get("recursive")) or "/" not in f.path[len(prefix) :]):
                entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
                if f.lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(lfs_pointer(f.sha256, f.size))}
                entries.append(entry)
        self.h._send(200, entries)

    def resolve(self, rid: str, revision: str, path: str) -> None:
        """hf_hub_download of a model repo's file (HEAD for its metadata, then GET), without redirects."""
        repo = self.get_repo("model", rid)
        head, tree = self.hub._tree(repo, revision)
        if path not in tree:
            raise HubError(404, "Entry not found", "EntryNotFound")
        f = tree[path]
        headers = {"X-Repo-Commit": head, "ETag": f'"{f.git_oid}"'}
        if f.lfs:
            headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
        self.h._send(200, self.hub._blobs[f.sha256], headers)

    # -- refs ------------------------------------------------------------------

    def branch(self, repo_type: str, rid: str, branch: str) -> None:
        repo = self.get_repo(repo_type, rid, write=True)
        if not branch or branch.startswith("refs/") or branch in repo.branches:
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            raise HubError(400, f"Invalid reference for a branch: {branch}")
        start = self.json().get("startingPoint")
        repo.branches[branch] = self.hub._resolve(repo, start or "main")
        self.h._send(200, {})

    # -- upload: preupload / LFS / commit -----------------------------------------------
