"""The fake Hub's upload endpoints (tests/hub_http.py's Router takes them in): preupload, the LFS batch
API and its upload target, and the NDJSON commit."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

from tests.hub_server import (
    HubError,
    StoredFile,
    git_blob_oid,
    lfs_pointer,
    truthy,
)


class UploadRoutes:
    """Endpoint methods of the Router (self.h the request, self.hub the FakeHub, self.json() the body)."""

    def preupload(self, repo_type: str, rid: str, revision: str) -> None:
        repo = self.get_repo(repo_type, rid, write=True)
        create_pr = truthy(self.query.get("create_pr"))
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
        if truthy(self.query.get("create_pr")):
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
                tree[path] = StoredFile(path, oid, size, True, git_blob_oid(lfs_pointer(oid, size)))
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
