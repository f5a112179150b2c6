import shutil
from pathlib import Path

import pytest

from draftsmith.export.run import export_checkpoint
from draftsmith.recipe import load_recipe
from tests.helpers import family_recipe, family_target, train_in_process

pytestmark = [pytest.mark.slow]


def test_scratch(tmp_path, small_data, token_cache):
    target = family_target("cohere2", tmp_path, token_cache, sliding_window=16)
    args = family_recipe(target, "draft", ["train.lr=3e-3"], tmp_path / "run", small_data, token_cache)
    final, _ = train_in_process(args)
    out = Path("/tmp/cd")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(target[0], out / "target")
    export_checkpoint(load_recipe([*args, f"export.output={out / 'export'}"]), final)
    shutil.copy(small_data["eval"], out / "eval.jsonl")
