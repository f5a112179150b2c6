"""vLLM's own EAGLE-3 code computes what draftsmith's drafter computes, for every vLLM layout draftsmith writes: vLLM's
speculative config resolves the exported folder to its model class, that class loads the folder's weights, picks the
target's tapped layers by the folder's ids, fuses them (the norms the folder names), runs its draft layer (the residual
the folder names, the window it names) and returns the draft vocabulary's logits and the feature it feeds its next
step; both equal draftsmith's for the same tokens and target states. Run in vLLM's environment on a CPU, without an
engine (its attention kernel replaced by plain causal attention within the window vLLM's layer holds).

The served acceptance of tests/test_engine_vllm.py cannot see a misread norm of a drafter that is hardly ever accepted;
this compares the numbers themselves, and shows it would see one: the same folder with each key it carries read the
other way (a norm flag flipped, the layer ids unshifted, the window dropped) computes something else, or does not load.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.export.run import load_source, served_config, stage_repo
from draftsmith.formats import exporter_for
from draftsmith.formats.eagle3 import NATIVE, PEAGLE, SPECULATORS
from draftsmith.heads.packing import draft_attention_mask
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target, run_target
from tests.helpers import KINDS, REFERENCE_TARGET, run_in_vllm, save_drafter

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

WINDOWED = {"sliding_window": "16"}  # shorter than the 23 positions drafted below
# Each layout with the keys it carries set away from the defaults of draftsmith and of vLLM's readers.
LAYOUT_DRAFTERS = {
    "speculators": (SPECULATORS, {**WINDOWED, "fc_norm": "true", "norm_output": "true",
                                  "norm_before_residual": "true"}),
    "native": (NATIVE, {**WINDOWED, "norm_before_fc": "true", "norm_output": "true", "norm_before_residual": "true"}),
    "peagle": (PEAGLE, {**WINDOWED, "fc_norm": "true", "norm_output": "true", "parallel_drafting": "true",
                        "mask_token_id": "5", "eval.tree": "0"}),  # P-EAGLE proposes chains only
}  # fmt: skip
FLAGS = ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")
WINDOW_KEYS = ("layer_types", "sliding_window", "use_sliding_window")

# Run by vLLM's Python: argv = target, inputs (safetensors), plan (JSON: name -> speculative config), port. For each
# folder: vLLM's model for it, its weights loaded (the target's embedding where the folder has none, as vLLM shares
# it), every layer's attention plain causal attention within the window vLLM's layer holds; the draft step over the
# given tokens and the target's states at vLLM's aux layer ids; its outputs saved, what vLLM built printed as one JSON
# line.
VLLM_SCRIPT = """
import json, sys, types
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu.spec_decode.eagle.utils import _should_share
from vllm_side import ContextThenBlock, engine_config, single_process

target, inputs, plan, port = sys.argv[1:]
given, outputs, said = load_file(inputs), {}, {}
positions, none = given["positions"], torch.empty(0, dtype=torch.long)
for number, (name, speculative) in enumerate(json.load(open(plan)).items()):
    try:
        config, spec = engine_config(target, speculative)
        with set_current_vllm_config(config):
            if number == 0:
                single_process(port)
            draft = spec.draft_model_config
            cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
            model = cls(vllm_config=config)
            model.load_weights(load_file(speculative["model"] + "/model.safetensors").items())
            process_weights_after_loading(model, draft, torch.device("cpu"))
            if _should_share(model, "has_own_embed_tokens", None, None):  # a folder without its own embedding
                model.model.embed_tokens.weight.data.copy_(given["table"])
            windows = []
            for layer in model.model.layers:
                attention = layer.self_attn
                window = attention.attn.sliding_window
                windows.append(window)
                shape = types.SimpleNamespace(num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
                                              head_dim=attention.head_dim, scaling=attention.scaling,
                                              sliding_window=window, causal=True)
                empty = torch.empty(0, attention.num_kv_heads, attention.head_dim)
                attention.attn = ContextThenBlock(shape, empty, empty, none, positions)
            ids = list(get_eagle3_aux_layers_from_config(spec))
            aux = torch.cat([given["hidden"][i] for i in ids], dim=-1)
            with torch.no_grad():
                hidden, fed_forward = model(given["tokens"], positions, model.combine_hidden_states(aux))
                logits = model.compute_logits(hidden)
        outputs[name + ".logits"], outputs[name + ".next"] = logits.contiguous(), fed_forward.contiguous()
        if spec.parallel_drafting:  # the feature of P-EAGLE's masked queries
            with torch.no_grad():
                outputs[name + ".mask"] = model.combine_hidden_states(model.mask_hidden).contiguous()
        said[name] = {"class": cls.__name__, "method": spec.method, "aux_layers": ids, "windows": windows,
                      "parallel_drafting": bool(spec.parallel_drafting)}
    except Exception as error:
        said[name] = {"error": f"{type(error).__name__}: {error}"[:400]}
save_file(outputs, inputs + ".vllm")
print(json.dumps(said))
"""


@pytest.fixture(scope="module")
def target():
    return load_target(str(REFERENCE_TARGET))


def read_other_way(config: dict, change) -> dict:
    """`config` with `change(holder)` applied to it and every dict nested in it (the layouts repeat keys in their
    layer config)."""
    config = json.loads(json.dumps(config))
    holders = [config]
    while holders:
        holder = holders.pop()
        change(holder)
        holders.extend(value for value in holder.values() if isinstance(value, dict))
    return config


def misreadings(config: dict, drafter_config) -> dict[str, dict]:
    """The folder's config.json read the other way on each key it carries: every norm flag draftsmith set (and
    norm_before_residual either way) flipped, the tapped layers' ids unshifted, the draft layer's window dropped."""

    def flipped(key):
        return lambda holder: holder.update({key: not holder[key]}) if key in holder else None

    def unshifted(holder):
        if "eagle_aux_hidden_state_layer_ids" in holder:
            holder["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in holder["eagle_aux_hidden_state_layer_ids"]]

    def windowless(holder):
        for key in WINDOW_KEYS:
            holder.pop(key, None)

    changes = {f"{key} flipped": flipped(key) for key in FLAGS
               if key == "norm_before_residual" or getattr(drafter_config, key)}  # fmt: skip
    changes |= {"layer ids unshifted": unshifted, "window dropped": windowless}
    return {name: read_other_way(config, change) for name, change in changes.items()}


def draftsmith_step(drafter, target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's first step over tokens ids[1:] with the target's fused states at ids[:-1]: its logits over the
    draft vocabulary and the feature it feeds its next step."""
    states = run_target(target, ids, request=type(drafter).features(drafter.config, drafter.target)).layers
    tokens, count = ids[:, 1:], ids.shape[1] - 1
    places = torch.arange(count)[None]
    with torch.no_grad():
        fused = drafter.fuse(states)[:, :count]
        mask = draft_attention_mask({"input_ids": tokens}, window=drafter.attention_window())
        fed_forward = drafter.draft(tokens, fused, places, mask)
        return drafter.draft_logits(fed_forward)[0], fed_forward[0]


@pytest.mark.parametrize("layout_name", list(LAYOUT_DRAFTERS))
def test_vllms_own_eagle3_code_computes_the_drafters_step_from_each_layout(layout_name, target, tmp_path, vllm_python):
    layout, drafter_keys = LAYOUT_DRAFTERS[layout_name]
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", **drafter_keys)
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path / 'run'}", "eval.tree=0"])
    source = load_source(cfg, checkpoint, target)
    drafter = source.drafter
    vllm_format = "native" if layout is NATIVE else "speculators"  # the folder as the export builds it
    assert exporter_for("eagle3").layout("vllm", drafter, vllm_format) is layout
    repo = exporter_for("eagle3").build("vllm", replace(source, vllm_format=vllm_format), 3, tmp_path / "folder")
    folder = stage_repo(repo, tmp_path / "folder", source.target)
    speculative = served_config(repo, 3, None, drafter)
    plan = {"as written": {**speculative, "model": str(folder)}}
    written = json.loads((folder / "config.json").read_text())
    for name, config in misreadings(written, drafter.config).items():
        misread = tmp_path / name.replace(" ", "_")
        shutil.copytree(folder, misread)
        (misread / "config.json").write_text(json.dumps(config))
        plan[name] = {**speculative, "model": str(misread)}
    (tmp_path / "plan.json").write_text(json.dumps(plan))

    ids = torch.randint(3, 4096, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states  # transformers' [embeddings, layer 0, ...]
    layers = target.config.num_hidden_layers  # the last is normed in transformers' tuple, not in vLLM's taps
    inputs = tmp_path / "inputs.safetensors"
    save_file({"hidden": torch.stack([h[0, :-1] for h in hidden[:layers]]).contiguous(), "tokens": ids[0, 1:].clone(),
               "positions": torch.arange(ids.shape[1] - 1),
               "table": target.get_input_embeddings().weight.detach().contiguous()}, str(inputs))  # fmt: skip
    done = run_in_vllm(vllm_python, VLLM_SCRIPT, tmp_path, REFERENCE_TARGET, inputs, tmp_path / "plan.json")
    assert done.returncode == 0, done.stderr[-3000:]
    said, computed = json.loads(done.stdout.strip().splitlines()[-1]), load_file(f"{inputs}.vllm")

    logits, fed_forward = draftsmith_step(drafter, target, ids)
    built = said.pop("as written")
    assert "error" not in built, built
    assert built["method"] == "eagle3" and built["parallel_drafting"] == drafter.config.parallel_drafting, built
    assert built["aux_layers"] == [i + 1 for i in drafter.config.aux_layers], built  # vLLM's ids: a layer's input
    assert built["windows"] == [drafter.config.sliding_window], built
    served_logits = computed["as written.logits"]
    in_draft_vocabulary = served_logits[:, drafter.draft_ids()]
    torch.testing.assert_close(in_draft_vocabulary, logits, rtol=1e-4, atol=1e-4)
    assert (served_logits == float("-inf")).sum(-1).eq(target.config.vocab_size - drafter.config.draft_vocab_size).all()
    torch.testing.assert_close(computed["as written.next"], fed_forward, rtol=1e-4, atol=1e-4)
    if drafter.config.parallel_drafting:
        with torch.no_grad():
            _, masked = drafter.mask_inputs(1, "cpu")
        torch.testing.assert_close(computed["as written.mask"], masked, rtol=1e-4, atol=1e-4)

    for name, what in said.items():  # each misreading shows: it does not load, or it computes something else
        if "error" in what:
            continue
        apart = max((computed[f"{name}.logits"][:, drafter.draft_ids()] - logits).abs().max(),
                    (computed[f"{name}.next"] - fed_forward).abs().max())  # fmt: skip
        assert apart > 1e-2, (name, float(apart))
