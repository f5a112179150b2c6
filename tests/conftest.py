"""Shared fixtures: the reference target, a small mixed-domain slice of the corpus, and a runner
for the real entry points as subprocesses (the way users call them)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("DRAFTSMITH_SHARED", REPO.parent / "shared"))
REFERENCE_TARGET = SHARED / "models" / "reference-target"
CORPUS = SHARED / "data" / "corpus"
DOMAINS = ("code", "docs", "math", "packages")


def corpus_slice(path: Path, split: str, per_domain: int) -> Path:
    """First `per_domain` records of each domain's split, interleaved, as one jsonl file."""
    rows = []
    for domain in DOMAINS:
        with gzip.open(CORPUS / f"{domain}.{split}.jsonl.gz", "rt") as f:
            rows.append([json.loads(line) for _, line in zip(range(per_domain), f)])
    with open(path, "w") as f:
        for group in zip(*rows):
            for row in group:
                f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {
        "train": corpus_slice(root / "train.jsonl", "train", 48),
        "eval": corpus_slice(root / "eval.jsonl", "eval", 6),
    }


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


def run_entry(args: list[str], cwd: Path = REPO, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python <args>` from the repo root and return the finished process (never raises)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def train_args(output_dir: Path, data: dict[str, Path], cache: Path, *extra: str) -> list[str]:
    """A quick Medusa run on the reference target and the small corpus slice."""
    return [
        "recipe=medusa",
        f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{data['train']}]",
        f"data.eval=[{data['eval']}]",
        f"data.cache_dir={cache}",
        "data.max_length=128",
        "train.micro_batch_size=4",
        "train.warmup_steps=2",
        "train.log_every=1",
        "eval.enabled=false",
        f"output_dir={output_dir}",
        *extra,
    ]
