"""A stdlib-only fake Hugging Face Hub for offline tests of the real `huggingface_hub` client.

Written against huggingface_hub 2.4.0. Start it on 127.0.0.1 (free port) in a background thread and
point the client at it with ``HfApi(endpoint=hub.url, token=...)``::

    with FakeHub(token="hf_test") as hub:
        api = HfApi(endpoint=hub.url, token="hf_test")
        api.create_repo("me/x", private=True, exist_ok=True)
        api.upload_folder(repo_id="me/x", folder_path=d, revision="main", commit_message="m")
        assert hub.files("me/x", "main")["weights.bin"] == open(...).read()

IMPORTANT client-side setting: with `hf_xet` installed (it is a hard dependency of huggingface_hub 2.x),
`upload_folder` / `create_commit` upload every non-"regular" file through Xet (CAS), which this server
does not implement. No server response turns that off: set ``HF_HUB_DISABLE_XET=1`` before importing
huggingface_hub, or patch ``huggingface_hub.constants.HF_HUB_DISABLE_XET = True`` (read at call time by
``huggingface_hub.utils._runtime.is_xet_available``). Then large files go through the legacy LFS batch API.

Endpoints (``{t}`` = models|datasets|spaces|kernels, ``{repo}`` = namespace/name, ``{rev}`` = URL-quoted,
``{prefix}`` = "" for models, "datasets/" etc. otherwise):

  POST   /api/repos/create                        {"name","organization","visibility"?,"type"?} -> {"url"} (409 + {"url"} if exists)
  DELETE /api/repos/delete                        {"name","organization","type"?}
  PUT    /api/{t}/{repo}/settings                 {"private"?, "visibility"?}
  GET    /api/whoami-v2
  POST   /api/validate-yaml                       -> {"errors": [], "warnings": []}
  GET    /api/{t}/{repo}[/revision/{rev}]         repo_info / model_info (sha = head of rev, siblings; ?blobs=true for sizes/lfs)
  POST   /api/{t}/{repo}/branch/{branch}          {"startingPoint"?} (409 if exists)
  DELETE /api/{t}/{repo}/branch/{branch}
  GET    /api/{t}/{repo}/refs                     {"branches","converts","tags","pullRequests"?}
  GET    /api/{t}/{repo}/commits/{rev}            newest first: [{"id","title","message","authors","date"}]
  GET    /api/{t}/{repo}/tree/{rev}[/{path}]      ?recursive=&expand=  (no pagination: one page)
  POST   /api/{t}/{repo}/paths-info/{rev}         form: paths=..&paths=..&expand=..
  POST   /api/{t}/{repo}/preupload/{rev}          {"files":[{"path","sample","size"}],"gitIgnore"?}
                                                  -> {"files":[{"path","uploadMode","shouldIgnore","oid"?}],"commitOid"}
  POST   /api/{t}/{repo}/commit/{rev}             NDJSON header/file/lfsFile/deletedFile/deletedFolder (?create_pr=1)
  POST   /{prefix}{repo}.git/info/lfs/objects/batch   LFS batch API, "basic" transfer
  PUT    /__lfs__/{prefix}{repo}/{oid}            LFS single-part upload target (sha256 + size verified; NO auth header)
  POST   /{prefix}{repo}.git/info/lfs/objects/verify  {"oid","size"}
  HEAD/GET /{prefix}{repo}/resolve/{rev}/{path}   hf_hub_download (X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size)
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FakeHub", "HubError", "git_blob_oid", "DEFAULT_GITATTRIBUTES"]

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}

# What the Hub puts in the "initial commit" of a new model repo (trimmed to the LFS rules that matter).
DEFAULT_GITATTRIBUTES = (
    "\n".join(
        f"{p} filter=lfs diff=lfs merge=lfs -text"
        for p in (
            "*.7z *.arrow *.bin *.bz2 *.ckpt *.ftz *.gz *.h5 *.joblib *.lfs *.mlmodel *.model *.msgpack *.npy *.npz "
            "*.onnx *.ot *.parquet *.pb *.pickle *.pkl *.pt *.pth *.rar *.safetensors saved_model/**/* *.tar.* *.tar "
            "*.tflite *.tgz *.wasm *.xz *.zip *.zst *tfevents*"
        ).split()
    )
    + "\n"
)


def git_blob_oid(data: bytes) -> str:
    """git's blob sha1 (what the client compares to the preupload `oid` for regular files)."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


class HubError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, extra: dict | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}
        self.headers = headers or {}


@dataclass
class StoredFile:
    path: str
    sha256: str  # key in FakeHub._blobs
    size: int
    lfs: bool
    git_oid: str  # git blob sha1 of the content (regular) or of the LFS pointer (lfs)

    @property
    def preupload_oid(self) -> str:
        # huggingface_hub compares this to CommitOperationAdd._local_oid: sha256 for lfs, git sha1 for regular.
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class Commit:
    id: str
    title: str
    description: str
    parents: list[str]
    date: str
    author: str
    branch: str
    tree: dict[str, StoredFile]
    added: list[str] = field(default_factory=list)  # paths added or modified by this commit
    deleted: list[str] = field(default_factory=list)


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    created_at: str
    branches: dict[str, str | None] = field(default_factory=dict)  # name -> head commit id (None: no commit yet)
    tags: dict[str, str] = field(default_factory=dict)
    pull_requests: dict[int, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs_oids: dict[str, int] = field(default_factory=dict)  # sha256 -> size, LFS objects uploaded to this repo
    last_modified: str = ""

    @property
    def key(self) -> str:
        return URL_PREFIX[self.repo_type] + self.repo_id


@dataclass
class RequestRecord:
    method: str
    path: str  # raw path incl. query string
    headers: dict[str, str]
    body: bytes
    status: int = 0


class FakeHub:
    """In-memory fake Hub. Thread-safe; one instance per test (or module) is cheap."""

    def __init__(
        self,
        *,
        token: str | None = None,
        user: str = "test-user",
        host: str = "127.0.0.1",
        port: int = 0,
        lfs_threshold: int = 10 * 1024 * 1024,
        initial_commit: bool = True,
        require_auth_for_write: bool = True,
    ) -> None:
        """
        token: if set, write calls must send ``Authorization: Bearer <token>`` (401 otherwise) and private repos
            are only visible with it. If None, any (or no) Authorization is accepted.
        lfs_threshold: preupload answers "lfs" for files of at least this many bytes (the Hub uses 10 MiB), for
            binary samples (NUL byte in the first 512 bytes) and for paths matching `.gitattributes` LFS rules.
        initial_commit: like the Hub, create_repo makes an "initial commit" holding `.gitattributes` on main.
        """
        self.token = token
        self.user = user
        self.lfs_threshold = lfs_threshold
        self.initial_commit = initial_commit
        self.require_auth_for_write = require_auth_for_write and token is not None
        self._host, self._port = host, port
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], Repo] = {}
        self._blobs: dict[str, bytes] = {}  # sha256 -> content (regular and lfs)
        self._counter = itertools.count()
        self.requests: list[RequestRecord] = []
        self.auth_headers: list[str] = []  # every Authorization header value received, in order
        self.errors: list[str] = []  # server-side exceptions (bugs), surfaced to tests
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake_hub = hub

        self._httpd = ThreadingHTTPServer((self._host, self._port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "FakeHub not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ test API

    @property
    def repos(self) -> dict[str, Repo]:
        """Repos keyed like Hub URLs: "ns/name" for models, "datasets/ns/name" etc. otherwise."""
        with self._lock:
            return {r.key: r for r in self._repos.values()}

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        with self._lock:
            return self._repos[(repo_type, repo_id)]

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        """Full file snapshot {path: content} at a branch / tag / commit id."""
        with self._lock:
            repo = self.repo(repo_id, repo_type)
            head = self._resolve(repo, revision)
            tree = repo.commits[head].tree if head else {}
            return {p: self._blobs[f.sha256] for p, f in sorted(tree.items())}

    def lfs_paths(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> set[str]:
        """Paths stored as LFS objects at `revision` (i.e. committed as lfsFile)."""
        with self._lock:
            repo = self.repo(repo_id, repo_type)
            head = self._resolve(repo, revision)
            return {p for p, f in (repo.commits[head].tree.items() if head else ()) if f.lfs}

    def commits(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[dict]:
        """History of `revision`, OLDEST first (first-parent chain). Each dict: id, title (=commit_message),
        description (=commit_description), parents, date, author, branch, added, deleted, lfs, files
        ({path: bytes} full snapshot)."""
        with self._lock:
            repo = self.repo(repo_id, repo_type)
            out = [
                {
                    "id": c.id,
                    "title": c.title,
                    "description": c.description,
                    "parents": list(c.parents),
                    "date": c.date,
                    "author": c.author,
                    "branch": c.branch,
                    "added": list(c.added),
                    "deleted": list(c.deleted),
                    "lfs": sorted(p for p, f in c.tree.items() if f.lfs),
                    "files": {p: self._blobs[f.sha256] for p, f in sorted(c.tree.items())},
                }
                for c in self._first_parent_chain(repo, revision)
            ]
            return out[::-1]

    def requests_to(self, method: str | None = None, contains: str = "") -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method) and contains in r.path]

    def leaks(self, secret: str) -> list[str]:
        """Where `secret` appeared in a request OTHER than in an Authorization header (paths, other headers,
        bodies). Empty list = the token only ever travelled as `Authorization: Bearer ...`."""
        needle = secret.encode()
        found = []
        with self._lock:
            for i, r in enumerate(self.requests):
                where = f"#{i} {r.method} {r.path}"
                if secret in unquote(r.path) or secret in r.path:
                    found.append(f"{where}: path")
                for k, v in r.headers.items():
                    if k.lower() != "authorization" and secret in v:
                        found.append(f"{where}: header {k}")
                if needle in r.body:
                    found.append(f"{where}: body")
        return found

    # ------------------------------------------------------------------ internals (call with lock held)

    def _new_id(self, *parts: Any) -> str:
        h = hashlib.sha1(json.dumps([next(self._counter), _now(), *map(str, parts)]).encode())
        return h.hexdigest()

    def _first_parent_chain(self, repo: Repo, revision: str | None):
        """The commits of `revision` and its first parents, newest first."""
        cid = self._resolve(repo, revision)
        while cid:
            commit = repo.commits[cid]
            yield commit
            cid = commit.parents[0] if commit.parents else None

    def _resolve(self, repo: Repo, revision: str | None) -> str | None:
        """branch / tag / refs/pr/N / commit id -> commit id. HubError 404 RevisionNotFound if unknown."""
        rev = revision or "main"
        if rev in repo.branches:
            return repo.branches[rev]
        if rev.startswith("refs/heads/") and rev[len("refs/heads/") :] in repo.branches:
            return repo.branches[rev[len("refs/heads/") :]]
        if rev in repo.tags:
            return repo.tags[rev]
        m = re.fullmatch(r"refs/pr/(\d+)", rev)
        if m and int(m.group(1)) in repo.pull_requests:
            return repo.pull_requests[int(m.group(1))]
        if rev in repo.commits:
            return rev
        matches = [c for c in repo.commits if len(rev) >= 7 and c.startswith(rev)]
        if len(matches) == 1:
            return matches[0]
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _tree(self, repo: Repo, revision: str | None) -> tuple[str | None, dict[str, StoredFile]]:
        head = self._resolve(repo, revision)
        return head, (repo.commits[head].tree if head else {})

    def _store(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self._blobs.setdefault(sha, data)
        return sha

    def _make_commit(
        self,
        repo: Repo,
        branch_ref: tuple[str, Any],
        title: str,
        description: str,
        tree: dict[str, StoredFile],
        added: list[str],
        deleted: list[str],
    ) -> Commit:
        kind, name = branch_ref
        parent = repo.branches[name] if kind == "branch" else repo.pull_requests[name]
        cid = self._new_id(repo.repo_id, title, sorted(tree))
        c = Commit(
            id=cid,
            title=title,
            description=description,
            parents=[parent] if parent else [],
            date=_now(),
            author=self.user,
            branch=name if kind == "branch" else f"refs/pr/{name}",
            tree=tree,
            added=added,
            deleted=deleted,
        )
        repo.commits[cid] = c
        if kind == "branch":
            repo.branches[name] = cid
        else:
            repo.pull_requests[name] = cid
        repo.last_modified = c.date
        return c

    def _gitattributes_lfs_patterns(self, tree: dict[str, StoredFile]) -> list[str]:
        f = tree.get(".gitattributes")
        if f is None:
            return []
        pats = []
        for line in self._blobs[f.sha256].decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 2 and "filter=lfs" in parts[1:]:
                pats.append(parts[0])
        return pats

    @staticmethod
    def _match(pattern: str, path: str) -> bool:
        pattern = pattern.lstrip("/")
        if "/" not in pattern:
            return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
        return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern.replace("**/", ""))

    def _upload_mode(self, path: str, size: int, sample: bytes, lfs_patterns: list[str]) -> str:
        if size >= self.lfs_threshold or b"\x00" in sample:
            return "lfs"
        if any(self._match(p, path) for p in lfs_patterns):
            return "lfs"
        return "regular"

    def _entry(self, f: StoredFile, repo: Repo, head: str | None, expand: bool) -> dict:
        d: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
        if f.lfs:
            d["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(_lfs_pointer(f.sha256, f.size))}
        if expand and head:
            c = self._last_commit_touching(repo, head, f.path)
            if c:
                d["lastCommit"] = {"id": c.id, "title": c.title, "date": c.date}
        return d

    def _last_commit_touching(self, repo: Repo, head: str, path: str) -> Commit | None:
        cid: str | None = head
        while cid:
            c = repo.commits[cid]
            if path in c.added:
                return c
            cid = c.parents[0] if c.parents else None
        return None


# ---------------------------------------------------------------------------------------------- HTTP layer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
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
            _Router(self, hub, body).dispatch()
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


class _Router:
    def __init__(self, h: _Handler, hub: FakeHub, body: bytes) -> None:
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
            # resolve: /{prefix}{ns}/{name}/resolve/{rev}/{path...}
            if "resolve" in s:
                i = s.index("resolve")
                repo_type, rid = self._repo_from_prefix(s[:i])
                return self.resolve(m, repo_type, rid, unquote(s[i + 1]), unquote("/".join(s[i + 2 :])))
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
        if s == ["repos", "delete"] and m == "DELETE":
            return self.delete_repo()
        if s == ["whoami-v2"] and m == "GET":
            if self.hub.token is not None and self._token() != self.hub.token:
                raise HubError(401, "Invalid credentials in Authorization header")
            return self.h._send(
                200, {"type": "user", "name": self.hub.user, "orgs": [], "auth": {"type": "access_token"}}
            )
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
            if action == "branch" and m in ("POST", "DELETE"):
                return self.branch(m, repo_type, rid, "/".join(args))
            if action == "refs" and m == "GET":
                return self.refs(repo_type, rid)
            if action == "commits" and m == "GET":
                return self.list_commits(repo_type, rid, "/".join(args) or "main")
            if action == "tree" and m == "GET":
                return self.tree(repo_type, rid, args[0] if args else "main", "/".join(args[1:]))
            if action == "paths-info" and m == "POST":
                return self.paths_info(repo_type, rid, "/".join(args))
            if action == "preupload" and m == "POST":
                return self.preupload(repo_type, rid, "/".join(args))
            if action == "commit" and m == "POST":
                return self.commit(repo_type, rid, "/".join(args))
            if action == "settings" and m == "PUT":
                return self.settings(repo_type, rid)
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
        repo = Repo(repo_id=rid, repo_type=repo_type, private=visibility == "private", created_at=_now())
        repo.branches["main"] = None
        repo.last_modified = repo.created_at
        self.hub._repos[(repo_type, rid)] = repo
        if self.hub.initial_commit:
            data = DEFAULT_GITATTRIBUTES.encode()
            f = StoredFile(".gitattributes", self.hub._store(data), len(data), False, git_blob_oid(data))
            self.hub._make_commit(repo, ("branch", "main"), "initial commit", "", {f.path: f}, [f.path], [])
        self.h._send(200, {"url": url, "name": rid, "id": self.hub._new_id(rid)})

    def delete_repo(self) -> None:
        self.require_write()
        p = self.json()
        repo_type = p.get("type") or "model"
        rid = f"{p.get('organization') or self.hub.user}/{p.get('name')}"
        if self.hub._repos.pop((repo_type, rid), None) is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        self.h._send(200, {})

    def settings(self, repo_type: str, rid: str) -> None:
        repo = self.get_repo(repo_type, rid, write=True)
        p = self.json()
        if "private" in p and p["private"] is not None:
            repo.private = bool(p["private"])
        if p.get("visibility") in ("private", "public"):
            repo.private = p["visibility"] == "private"
        self.h._send(200, {})

    def repo_info(self, repo_type: str, rid: str, revision: str | None) -> None:
        repo = self.get_repo(repo_type, rid)
        head, tree = self.hub._tree(repo, revision)
        blobs = _truthy(self.query.get("blobs"))
        siblings = []
        for f in sorted(tree.values(), key=lambda f: f.path):
            sib: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sib.update(size=f.size, blobId=f.git_oid)
                if f.lfs:
                    sib["lfs"] = {
                        "size": f.size,
                        "sha256": f.sha256,
                        "pointerSize": len(_lfs_pointer(f.sha256, f.size)),
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

    # -- refs ------------------------------------------------------------------

    def branch(self, m: str, repo_type: str, rid: str, branch: str) -> None:
        repo = self.get_repo(repo_type, rid, write=True)
        if m == "DELETE":
            if branch == "main":
                raise HubError(403, "Cannot delete the main branch")
            if branch not in repo.branches:
                raise HubError(404, f"Branch {branch} not found", "RevisionNotFound")
            del repo.branches[branch]
            return self.h._send(200, {})
        if not branch or branch.startswith("refs/") or branch in repo.branches:
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            raise HubError(400, f"Invalid reference for a branch: {branch}")
        start = self.json().get("startingPoint")
        repo.branches[branch] = self.hub._resolve(repo, start or "main")
        self.h._send(200, {})

    def refs(self, repo_type: str, rid: str) -> None:
        repo = self.get_repo(repo_type, rid)
        out: dict[str, Any] = {
            "branches": [
                {"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in repo.branches.items() if c
            ],
            "converts": [],
            "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c} for t, c in repo.tags.items()],
        }
        if _truthy(self.query.get("include_prs")):
            out["pullRequests"] = [
                {"name": str(n), "ref": f"refs/pr/{n}", "targetCommit": c} for n, c in repo.pull_requests.items()
            ]
        self.h._send(200, out)

    def list_commits(self, repo_type: str, rid: str, revision: str) -> None:
        repo = self.get_repo(repo_type, rid)
        out = [
            {
                "id": c.id,
                "title": c.title,
                "message": c.description,
                "authors": [{"user": c.author, "avatar": ""}],
                "date": c.date,
                "formatted": {"title": c.title, "message": c.description},
            }
            for c in self.hub._first_parent_chain(repo, revision)
        ]
        self.h._send(200, out)

    # -- tree / paths-info ---------------------------------------------------------

    def tree(self, repo_type: str, rid: str, revision: str, path: str) -> None:
        repo = self.get_repo(repo_type, rid)
        head, files = self.hub._tree(repo, revision)
        recursive, expand = _truthy(self.query.get("recursive")), _truthy(self.query.get("expand"))
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in files):
            raise HubError(404, f"Path {path} not found", "EntryNotFound")
        entries: dict[str, dict] = {}
        for p, f in sorted(files.items()):
            if not p.startswith(prefix):
                continue
            rel = p[len(prefix) :].split("/")
            for depth in range(1, len(rel)):  # intermediate folders
                folder = prefix + "/".join(rel[:depth])
                if depth == 1 or recursive:
                    entries.setdefault(
                        folder,
                        {
                            "type": "directory",
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0,
                            "path": folder,
                        },
                    )
                if not recursive:
                    break
            if len(rel) == 1 or recursive:
                entries[p] = self.hub._entry(f, repo, head, expand)
        self.h._send(200, list(entries.values()))

    def paths_info(self, repo_type: str, rid: str, revision: str) -> None:
        repo = self.get_repo(repo_type, rid)
        head, files = self.hub._tree(repo, revision)
        ctype = self.h.headers.get("Content-Type", "")
        if "json" in ctype:
            p = self.json()
            paths, expand = p.get("paths", []), bool(p.get("expand"))
        else:
            form = parse_qs(self.body.decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), _truthy((form.get("expand") or ["false"])[-1])
        out = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                out.append(self.hub._entry(files[path], repo, head, expand))
            elif any(p.startswith(path + "/") for p in files):
                out.append(
                    {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}
                )
        self.h._send(200, out)

    # -- upload: preupload / LFS / commit -----------------------------------------------

    def preupload(self, repo_type: str, rid: str, revision: str) -> None:
        repo = self.get_repo(repo_type, rid, write=True)
        create_pr = _truthy(self.query.get("create_pr"))
        head, files = self.hub._tree(repo, revision)
        p = self.json()
        lfs_patterns = self.hub._gitattributes_lfs_patterns(files)
        gitignore = p.get("gitIgnore")
        if gitignore is None and ".gitignore" in files:
            gitignore = self.hub._blobs[files[".gitignore"].sha256].decode(errors="replace")
        ignore_patterns = [
            line.strip() for line in (gitignore or "").splitlines() if line.strip() and not line.startswith("#")
        ]
        out = []
        for item in p.get("files", []):
            path, size = item["path"], int(item["size"])
            sample = base64.b64decode(item.get("sample") or "")
            entry: dict[str, Any] = {
                "path": path,
                "uploadMode": self.hub._upload_mode(path, size, sample, lfs_patterns),
                "shouldIgnore": any(self.hub._match(pat.rstrip("/"), path) for pat in ignore_patterns),
            }
            if path in files and not create_pr:
                entry["oid"] = files[path].preupload_oid
            out.append(entry)
        self.h._send(200, {"files": out, "commitOid": head})

    def lfs_api(self, m: str, repo_type: str, rid: str, rest: list[str]) -> None:
        repo = self.get_repo(repo_type, rid, write=True)
        lfs_ct = "application/vnd.git-lfs+json"
        if rest == ["batch"] and m == "POST":
            p = self.json()
            if p.get("operation") != "upload":
                raise HubError(400, "fake hub only implements LFS 'upload' batches")
            transfers = p.get("transfers") or ["basic"]
            if "basic" not in transfers:
                raise HubError(400, f"fake hub only implements the 'basic' LFS transfer, client asked {transfers}")
            objects = []
            for obj in p.get("objects", []):
                oid, size = obj["oid"], int(obj["size"])
                o: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
                if not re.fullmatch(r"[0-9a-f]{64}", oid):
                    o["error"] = {"code": 422, "message": "Invalid oid"}
                elif repo.lfs_oids.get(oid) != size:  # already present => no "actions" => client skips upload
                    o["actions"] = {
                        "upload": {"href": f"{self.hub.url}/__lfs__/{repo.key}/{oid}?size={size}", "expires_in": 3600},
                        "verify": {
                            "href": f"{self.hub.url}/{repo.key}.git/info/lfs/objects/verify",
                            "expires_in": 3600,
                        },
                    }
                objects.append(o)
            return self.h._send(
                200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}, content_type=lfs_ct
            )
        if rest == ["verify"] and m == "POST":
            p = self.json()
            if repo.lfs_oids.get(p.get("oid")) != p.get("size"):
                raise HubError(404, f"LFS object {p.get('oid')} not found (or wrong size)")
            return self.h._send(200, {"success": True}, content_type=lfs_ct)
        raise HubError(404, f"fake hub: no LFS route {m} {rest}")

    def lfs_put(self, m: str, s: list[str]) -> None:
        # /__lfs__/{prefix}{ns}/{name}/{oid}   -- plays the role of the pre-signed S3 URL: no auth expected
        if m != "PUT" or len(s) < 3:
            raise HubError(404, "bad LFS upload URL")
        repo_type, rid = self._repo_from_prefix(s[:-1])
        repo = self.hub._repos.get((repo_type, rid))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        oid, data = s[-1], self.body
        expected_size = int(self.query.get("size", len(data)))
        actual = hashlib.sha256(data).hexdigest()
        if actual != oid or len(data) != expected_size:
            raise HubError(
                400, f"LFS upload mismatch: sha256 {actual} size {len(data)}, expected {oid} size {expected_size}"
            )
        self.hub._store(data)
        repo.lfs_oids[oid] = len(data)
        self.h._send(200, None, headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})

    def commit(self, repo_type: str, rid: str, revision: str) -> None:
        repo = self.get_repo(repo_type, rid, write=True)
        lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "First NDJSON line must be the header")
        header = lines[0]["value"]
        title, description = header.get("summary") or "", header.get("description") or ""
        if not title:
            raise HubError(400, "Commit summary is required")
        if _truthy(self.query.get("create_pr")):
            base = self.hub._resolve(repo, revision)
            num = max([0, *repo.pull_requests]) + 1
            repo.pull_requests[num] = base
            target: tuple[str, Any] = ("pr", num)
            pr_url = f"{self.hub.url}/{repo.key}/discussions/{num}"
        else:
            m = re.fullmatch(r"refs/pr/(\d+)", revision)
            if m and int(m.group(1)) in repo.pull_requests:
                target = ("pr", int(m.group(1)))
            elif revision in repo.branches:
                target = ("branch", revision)
            else:
                raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch)", "RevisionNotFound")
            pr_url = None
        head = repo.branches[target[1]] if target[0] == "branch" else repo.pull_requests[target[1]]
        parent = header.get("parentCommit")
        if parent is not None and parent != head:
            raise HubError(412, f"Parent commit {parent} is not the head of {revision} ({head})")
        tree = dict(repo.commits[head].tree) if head else {}
        added, deleted = [], []
        for line in lines[1:]:
            key, v = line.get("key"), line.get("value", {})
            path = v.get("path", "").strip("/")
            if key == "file":
                if v.get("encoding", "base64") != "base64":
                    raise HubError(400, f"Unsupported encoding {v.get('encoding')}")
                data = base64.b64decode(v["content"])
                tree[path] = StoredFile(path, self.hub._store(data), len(data), False, git_blob_oid(data))
                added.append(path)
            elif key == "lfsFile":
                oid = v["oid"]
                if v.get("algo", "sha256") != "sha256":
                    raise HubError(400, "Only sha256 LFS oids are supported")
                if oid not in repo.lfs_oids:
                    raise HubError(422, f"LFS object {oid} for {path} was never uploaded to this repo")
                size = repo.lfs_oids[oid]
                if v.get("size") is not None and int(v["size"]) != size:
                    raise HubError(422, f"LFS size mismatch for {path}")
                tree[path] = StoredFile(path, oid, size, True, git_blob_oid(_lfs_pointer(oid, size)))
                added.append(path)
            elif key == "deletedFile":
                if path not in tree:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del tree[path]
                deleted.append(path)
            elif key == "deletedFolder":
                gone = [p for p in tree if p.startswith(path + "/")]
                if not gone:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in gone:
                    del tree[p]
                deleted.extend(gone)
            else:
                raise HubError(400, f"fake hub: unsupported commit operation {key!r}")
        c = self.hub._make_commit(repo, target, title, description, tree, added, deleted)
        self.h._send(
            200,
            {
                "success": True,
                "commitOid": c.id,
                "commitUrl": f"{self.hub.url}/{repo.key}/commit/{c.id}",
                "hookOutput": "",
                "pullRequestUrl": pr_url,
            },
        )

    # -- download --------------------------------------------------------------

    def resolve(self, m: str, repo_type: str, rid: str, revision: str, path: str) -> None:
        if m not in ("GET", "HEAD"):
            raise HubError(405, "Method not allowed")
        repo = self.get_repo(repo_type, rid)
        head, files = self.hub._tree(repo, revision)
        f = files.get(path)
        if f is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": head} if head else None)
        data = self.hub._blobs[f.sha256]
        headers = {"X-Repo-Commit": head, "Content-Length": str(len(data)), "Accept-Ranges": "bytes"}
        if f.lfs:
            headers.update({"ETag": f'"{f.sha256}"', "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
        else:
            headers["ETag"] = f'"{f.git_oid}"'
        rng = self.h.headers.get("Range")
        status = 200
        if rng and m == "GET":
            mr = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if mr:
                start, end = int(mr.group(1)), int(mr.group(2) or len(data) - 1)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                data = data[start : end + 1]
                headers["Content-Length"] = str(len(data))
                status = 206
        self.h._send(status, data, headers)
