"""Which of vLLM's MTP models run the first draft step's depth at every step once compiled, read from the releases'
source, and what vLLM's own compile decorator does with a draft step's index (run in a vLLM environment).

    python benchmarks/vllm_compiled_mtp_steps.py --vllm 0.32.0=SITE_PACKAGES \
        --vllm 0.33.0=WHEELS/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl \
        --vllm 0.34.0=WHEELS/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl \
        [--vllm-python ENGINE_PYTHON]

For every target architecture whose MTP depths draftsmith trains several of (heads/mtp_layouts.py, `step_depths`): the
class vLLM's GPU builds serve them with (its speculative-decoding registry entry; in a `vllm.models.X` package, the
nvidia module's), and whether that class, a class it derives from in its module, or a module class whose forward
reads `spec_step_idx` is wrapped by `@support_torch_compile` without an `enable_if`. Such a model is compiled at its
first call with every guard dropped (vllm/compilation/wrapper.py), so the depth that call ran is every later step's
(formats/mtp.py's COMPILED_ONCE, which tests/test_families_vllm.py checks against the installed vLLM).
`--vllm-python`: that environment's vLLM decorator is run on a module choosing its layer by `spec_step_idx`, compiled
(CompilationMode.VLLM_COMPILE) and not (NONE), and the layer each of three steps ran is printed.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.vllm_probe import engine_python  # noqa: E402
from benchmarks.vllm_targets_table import read_source  # noqa: E402

REGISTRY = "vllm/model_executor/models/registry.py"
# target architecture -> the architecture vLLM's speculative config serves its MTP layers as (SpeculativeConfig.
# hf_config_override, 0.32.0 to 0.34.0)
MTP_CLASSES = {
    "DeepseekV3ForCausalLM": "DeepSeekMTPModel",
    "DeepseekV32ForCausalLM": "DeepseekV32MTPModel",
    "GlmMoeDsaForCausalLM": "DeepseekV32MTPModel",
    "Glm4MoeForCausalLM": "Glm4MoeMTPModel",
    "DeepseekV4ForCausalLM": "DeepSeekV4MTPModel",
    "HYV4ForCausalLM": "HYV4MTPModel",
    "Dots3NoteForCausalLM": "Dots3NoteMTPModel",
    "InklingForConditionalGeneration": "InklingMTPModel",
    "HYV3ForCausalLM": "HYV3MTPModel",
    "BailingMoeV3ForCausalLM": "BailingMoeV3MTPModel",
    "ExaoneMoeForCausalLM": "ExaoneMoeMTP",
    "Exaone4_5_ForConditionalGeneration": "Exaone4_5_MTP",
    "Qwen3NextForCausalLM": "Qwen3NextMTP",
    "Qwen3_5ForCausalLM": "Qwen3_5MTP",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5MTP",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeMTP",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeMTP",
    "Glm5NextForConditionalGeneration": "Glm5NextMTPModel",
}
# run by --vllm-python's interpreter: vLLM's decorator on three layers chosen by the step, as its MTP models choose
DECORATOR_RUN = """
import json, torch, vllm
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config

@support_torch_compile
class Depths(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.layers[spec_step_idx % 3](hidden_states)

ran = {}
for mode in (CompilationMode.VLLM_COMPILE, CompilationMode.NONE):
    config = VllmConfig(compilation_config=CompilationConfig(mode=mode))
    with set_current_vllm_config(config), torch.no_grad():
        torch.manual_seed(0)
        model, hidden = Depths(vllm_config=config), torch.randn(4, 8)
        alone = [layer(hidden) for layer in model.layers]
        served = [model(hidden, spec_step_idx=step) for step in range(3)]
    ran[mode.name] = [next(j for j, out in enumerate(alone) if torch.equal(out, got)) for got in served]
print(json.dumps({"vllm": vllm.__version__, "step_ran_layer": ran}))
"""


def holds(path: Path, name: str) -> bool:
    """Whether a wheel, or the site-packages folder holding an installed vllm, has the file `name`."""
    if path.is_dir():
        return (path / name).is_file()
    with zipfile.ZipFile(path) as wheel:
        return name in wheel.namelist()


def registry_entries(source: Path) -> dict[str, tuple[str, str]]:
    """Every `"Architecture": ("module", "Class")` entry of the registry's dict literals."""
    entries = {}
    for node in ast.walk(ast.parse(read_source(source, REGISTRY))):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and len(value.elts) == 2:
                    module, name = (getattr(part, "value", None) for part in value.elts)
                    if isinstance(module, str) and isinstance(name, str):
                        entries[key.value] = (module, name)
    return entries


def module_file(source: Path, module: str) -> str:
    """The file a registry module names, as vLLM's GPU builds import it: a `vllm.models.X` package's nvidia module
    (its common one where it has no other)."""
    if module.startswith("vllm.models."):
        package = "vllm/models/" + module.removeprefix("vllm.models.").replace(".", "/")
        kept = (f"{package}/nvidia/mtp.py", f"{package}/common/mtp.py", f"{package}/mtp.py")
        return next(name for name in kept if holds(source, name))
    return f"vllm/model_executor/models/{module}.py"


def compiled_without_enable_if(node: ast.ClassDef) -> bool:
    decorators = [ast.unparse(d) for d in node.decorator_list if "support_torch_compile" in ast.unparse(d)]
    return bool(decorators) and not any("enable_if" in d for d in decorators)


def compiled_once(source: Path, module: str, name: str) -> dict:
    """Whether the class `name` of `module` runs its first call's depth at every step once compiled: it or a base in
    its module is compiled without an enable_if, or a class of the module whose forward reads the step is."""
    path = module_file(source, module)
    classes = {n.name: n for n in ast.parse(read_source(source, path)).body if isinstance(n, ast.ClassDef)}
    chain, seen = [name], set()
    while chain:  # the class and the bases defined in its module
        current = chain.pop()
        if current in classes and current not in seen:
            seen.add(current)
            chain += [ast.unparse(base) for base in classes[current].bases]
    readers = {
        n
        for n, node in classes.items()
        if any(isinstance(f, ast.FunctionDef) and f.name == "forward" and "spec_step_idx" in ast.unparse(f)
               for f in node.body)
    }  # fmt: skip
    compiled = sorted(n for n in seen | readers if compiled_without_enable_if(classes[n]))
    return {"class": name, "file": path, "compiled_classes": compiled, "compiled_once": bool(compiled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", action="append", default=[], metavar="RELEASE=PATH", help="a wheel or site-packages")
    parser.add_argument("--vllm-python", type=engine_python, help="also run this environment's vLLM decorator")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    began = time.perf_counter()
    releases = {}
    for given in args.vllm:
        release, _, path = given.partition("=")
        source = Path(path)
        entries = registry_entries(source)
        releases[release] = {
            target: compiled_once(source, *entries[served]) if served in entries else None
            for target, served in MTP_CLASSES.items()
        }
    result = {"benchmark": "vllm_compiled_mtp_steps", "releases": releases}
    if args.vllm_python:
        run = subprocess.run([args.vllm_python, "-c", DECORATOR_RUN], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            sys.exit(f"error: vLLM's decorator run failed: {run.stderr.strip().splitlines()[-1:]}")
        result["decorator_run"] = json.loads(run.stdout.strip().splitlines()[-1])
    result |= provenance(None, began)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
