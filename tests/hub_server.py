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

Endpoints, the ones draftsmith's push (export/push.py: create_repo, create_branch, upload_folder)
reaches (``{t}`` = models|datasets|spaces|kernels, ``{repo}`` = namespace/name, ``{rev}`` = URL-quoted,
``{prefix}`` = "" for models, "datasets/" etc. otherwise):

  POST   /api/repos/create                        {"name","organization","visibility"?,"type"?} -> {"url"}
                                                  (409 + {"url"} if exists)
  POST   /api/validate-yaml                       -> {"errors": [], "warnings": []}
  GET    /api/{t}/{repo}[/revision/{rev}]         repo_info / model_info (sha = head of rev, siblings;
                                                  ?blobs=true for sizes/lfs)
  POST   /api/{t}/{repo}/branch/{branch}          {"startingPoint"?} (409 if exists)
  GET    /api/{t}/{repo}/tree/{rev}[/{path}]      list_repo_tree (files only, one page; ?recursive=true)
  GET    /{repo}/resolve/{rev}/{path}             hf_hub_download of a model repo's file (HEAD too)
  POST   /api/{t}/{repo}/preupload/{rev}          {"files":[{"path","sample","size"}],"gitIgnore"?}
                                                  -> {"files":[{"path","uploadMode","shouldIgnore","oid"?}],"commitOid"}
  POST   /api/{t}/{repo}/commit/{rev}             NDJSON header/file/lfsFile/deletedFile/deletedFolder (?create_pr=1)
  POST   /{prefix}{repo}.git/info/lfs/objects/batch   LFS batch API, "basic" transfer
  PUT    /__lfs__/{prefix}{repo}/{oid}            LFS single-part upload target (sha256 + size verified; NO auth header)
  POST   /{prefix}{repo}.git/info/lfs/objects/verify  {"oid","size"}

This module holds the Hub's data model (repositories, commits, trees, LFS objects) and FakeHub; the
HTTP side, one method per endpoint, is tests/hub_http.py.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

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


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def truthy(v: str | None) -> bool:
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
        from tests.hub_http import RequestHandler  # the HTTP side imports this module's data model

        hub = self

        class Handler(RequestHandler):
            fake_hub = hub

        self._httpd = ThreadingHTTPServer((self._host, self._port), Handler)
        self._httpd.daemon_threads = True
        # stop() waits until serve_forever next looks, every 0.5 s by default: every test with a Hub paid it
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01}, name="fake-hub", daemon=True
        )
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
        h = hashlib.sha1(json.dumps([next(self._counter), now_iso(), *map(str, parts)]).encode())
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
            date=now_iso(),
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


# ---------------------------------------------------------------------------------------------- HTTP layer
