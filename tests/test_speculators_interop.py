"""speculators (vLLM's drafter trainer, the peer users compare with) reads draftsmith's exports with its
own loader, and its draft model computes what draftsmith's drafter computes. Every speculators-format
folder draftsmith writes (EAGLE-3, EAGLE-3.1, P-EAGLE) loads through `SpeculatorModelConfig.from_pretrained`
and `SpeculatorModel.from_pretrained` in speculators 0.9.0 (its own venv: it pins transformers <= 5.19),
and every tensor of the folder, the target's embedding included, is in the loaded model bit for bit,
with nothing of the model left unfilled but what it takes from the verifier itself (`verifier_lm_head`,
`verifier_norm`, used by its training only). Without the embedding in the folder, speculators ran the
draft on an all-zero embedding, silently.

Function equivalence: on the same prompt, speculators' draft model, run by its own `forward` on the
target's states picked by the folder's `eagle_aux_hidden_state_layer_ids` (the target's
`output_hidden_states`, vLLM's convention: id i is the input of layer i), proposes the same greedy
chain of 7 tokens (mapped to target ids with the folder's `d2t`) as draftsmith's proposer, its logits
within 1e-4 of ours, at every step. This checks the layer ids, the norms (EAGLE-3.1's `fc_norm`,
`norm_output`, speculators' `norm_before_fc`), the vocabulary map and P-EAGLE's mask token and `mask_hidden`
as speculators reads them (the drafters train 2 steps, so their chains repeat tokens: the logits, over the
whole draft vocabulary, are the sharp check; a layer id off by one moved them by 5, a dropped `d2t` by 0.5).
speculators 0.9.0 has no inference entry point: EAGLE-3's chain comes from its training forward (the
training-time test), whose teacher forcing feeds the last prompt slot the chain drafted so far, one
forward per token; P-EAGLE's from its training forward with the sampled depths fixed to one chain
after the last prompt slot (vLLM's parallel drafting: the root, then mask queries).

The other direction: a checkpoint speculators itself saves (its trainer's default EAGLE-3 draft for the
target, built by its own classes in its own random init, saved in bfloat16 as its checkpointer saves
one) is read by `open_drafter` (the eval's) into a drafter that proposes the chain speculators' forward
proposes on the same states, logits within 1e-4, and `warm_start` (training's) returns every tensor of
the folder to the bit. What such a folder may set that draftsmith cannot compute is refused in one line
(tests/test_export.py, without speculators).

And speculators' offline dataset class reads the features draftsmith writes in its format
(data_prep/speculators_features.py; their contents are checked in tests/test_speculators_features.py): every row,
split as its trainer splits it. Everything speculators runs here runs in one process: its imports take about 12 s."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from draftsmith.eval.loop import prefill
from draftsmith.export.run import export_checkpoint
from draftsmith.formats.folder import open_drafter, warm_start
from draftsmith.heads import drafter_class
from draftsmith.heads.base import load_drafter
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetShape, load_target, load_tokenizer
from tests.helpers import REFERENCE_TARGET, speculators_features, train_in_process

pytestmark = pytest.mark.slow

CASES = {
    "eagle3": ["drafter.norm_before_fc=true"],  # speculators' own norm over the concatenated taps
    "eagle3.1": ["drafter.fc_norm=true", "drafter.norm_output=true"],
    # ttt_steps 3: a P-EAGLE chain is at most as deep as it trained, and the export serves the eval's γ 3
    "peagle": [
        "drafter.parallel_drafting=true",
        "drafter.mask_token_id=5",
        "drafter.fc_norm=true",
        "eval.tree=0",
        "drafter.ttt_steps=3",
    ],
}
DRAFT_TOKENS = 7
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
# Run by the speculators venv's Python: load the folder with speculators' own loader and compare its
# state dict with the folder's tensors; then draft on the saved target states with speculators' forward.
CHECK = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
import speculators.models.peagle.core as peagle_core
from speculators.losses import resolve_loss_config


def check(folder, states, out, gamma):
    config = SpeculatorModelConfig.from_pretrained(folder)
    # speculators' default attention is flex attention with block masks (compiled, for CUDA); its trainer's
    # --draft-attn-impl sdpa is the dense-mask path, which runs on CPU.
    config.transformer_layer_config._attn_implementation = "sdpa"
    # float32, as draftsmith drafts on CPU (a checkpoint of speculators' trainer is saved in bfloat16)
    model = SpeculatorModel.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    loaded, shipped = model.state_dict(), load_file(folder + "/model.safetensors")
    saved, gamma = load_file(states), int(gamma)
    # The target's states by speculators' layer ids (vLLM's: id i is layer i's input), concatenated as its
    # data holds them, one slot per prompt position but the last; slot i holds the token after it (the
    # shifted layout of speculators/models/eagle3/data.py).
    aux = torch.cat([saved["layer_inputs"][i] for i in model.config.eagle_aux_hidden_state_layer_ids], -1)[None]
    aux, n, prompt = aux.to(model.dtype), aux.shape[1], saved["input_ids"]
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[0].float()))
    to_target = lambda draft: draft + model.d2t[draft] if model.d2t is not None else draft
    with torch.no_grad():
        if model.config.speculators_model_type == "peagle":
            # One rollout: every slot at depth 0, then depths 1..gamma-1 (mask queries) after the last slot.
            anchor = torch.cat([torch.arange(n), torch.full((gamma - 1,), n - 1)])
            depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, gamma)])
            peagle_core.generate_cod_sample_indices = lambda *args, **kwargs: (anchor, depth)
            ids = torch.cat([prompt[1:], torch.zeros(gamma - 1, dtype=torch.long)])[None]  # past the prompt: never read
            hidden = torch.cat([aux, aux.new_zeros(1, gamma - 1, aux.shape[-1])], 1)
            zeros = hidden.new_zeros(1, n + gamma - 1, model.hidden_size)  # its loss's targets: unused here
            # Its forward always computes its loss: the eager one, as its trainer's --loss-implementation
            # eager (the default fused loss needs Triton).
            loss = resolve_loss_config("kl_div", "eager")
            model(
                hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids),
                verifier_last_hidden_states=zeros, loss_config=loss,
            )
            steps = logits[0][n - 1 :]
            proposed = to_target(steps.argmax(-1)).tolist()
        else:
            # The training-time test: at step s the last slot reads its own earlier output and, by teacher
            # forcing, the input token s places on: the chain drafted so far, appended (the slots past the
            # prompt are never seen by the prompt's). One forward per drafted token.
            proposed = []
            for step in range(gamma):
                logits.clear()
                ids = torch.cat([prompt[1:], torch.tensor(proposed, dtype=torch.long)])[None]
                hidden = torch.cat([aux, aux.new_zeros(1, step, aux.shape[-1])], 1)
                model(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=step + 1)
                proposed.append(int(to_target(logits[-1][n - 1].argmax())))
            steps = torch.stack([step_logits[n - 1] for step_logits in logits])
    save_file({"logits": steps.contiguous()}, out)
    return {
        "config": type(config).__name__,
        "model": type(model).__name__,
        "attention": model._attn_impl,
        "not_loaded": sorted(set(shipped) - set(loaded)),
        "not_shipped": sorted(set(loaded) - set(shipped)),
        "differ": sorted(
            k for k in shipped if k in loaded and not torch.equal(loaded[k].to(shipped[k].dtype), shipped[k])
        ),
        "embedding_sum": float(loaded["embed_tokens.weight"].float().abs().sum()),
        "proposed": proposed,
    }
"""


# Run by the speculators venv's Python with CHECK, for a job that gives `build` (the target, the window): an EAGLE-3
# draft model as speculators' trainer builds one by default for this target (one Llama layer with a sliding
# window, 2048 by default, norm_before_residual, norm_before_fc and norm_output, a pruned vocabulary), in its own
# random init, embedding and lm_head from the verifier, saved as its checkpointer saves every checkpoint (bfloat16).
BUILD = """
from pathlib import Path
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
from speculators.train.cli import create_transformer_layer_config


def build(folder, target, window):
    torch.manual_seed(0)
    layer = create_transformer_layer_config(
        verifier_name_or_path=target, num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=window,
        full_attention_indices=[],
    )
    kept = torch.randperm(layer.vocab_size)[:2048].sort().values
    t2d = torch.zeros(layer.vocab_size, dtype=torch.bool).index_fill_(0, kept, True)
    draft = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=kept - torch.arange(len(kept)), draft_vocab_size=len(kept),
        norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=3, verifier_name_or_path=target,
        target_layer_ids=[1, 2, 3],
        draft_attn_impl="sdpa",
    )
    draft.save_pretrained(folder, state_dict=convert_float_dtype(draft.state_dict(), torch.bfloat16))
    patch_config_dtype(Path(folder) / "config.json", torch.bfloat16)
"""
# speculators' offline reader over a features folder: every row read back, split as its trainer splits it
READ_FEATURES = """
from speculators.train.data import ArrowDataset


def read_features(datapath):
    data = ArrowDataset(max_len=4096, datapath=datapath, on_missing="raise", hidden_states_dtype=torch.float32)
    rows = [data[i] for i in range(len(data))]
    return {"rows": len(rows),
            "shapes": [[list(r["hidden_states"].shape), list(r["verifier_last_hidden_states"].shape)] for r in rows],
            "masked": [int(r["loss_mask"].sum()) for r in rows]}
"""
# The jobs (argv[1], JSON) and the features folder (argv[2]) in one process: speculators' imports take about 12 s.
RUN_JOBS = """
findings = {}
for job in json.loads(sys.argv[1]):
    if job["build"]:
        build(job["folder"], *job["build"])
    findings[job["name"]] = check(job["folder"], job["states"], job["out"], job["gamma"])
findings["features"] = read_features(sys.argv[2])
print(json.dumps(findings))
"""
FEATURES = "features"  # RUN_JOBS's name for the features folder's findings, beside the cases'
FEATURE_ROWS = 3
SPECULATORS_DEFAULTS = ["norm_before_residual", "norm_before_fc", "norm_output"]  # its trainer's, for EAGLE-3
WINDOWS = {"default-window": 2048, "window-inside-the-prompt": 8}


def target_states(target, recipe, path) -> list[int]:
    """PROMPT's tokens and the input of every target layer (HF's hidden_states: what vLLM's layer ids
    index) over the prompt but its last token (the root), saved to `path`; returns the tokens."""
    prompt = load_tokenizer(recipe.target)(PROMPT)["input_ids"]
    with torch.no_grad():
        layer_inputs = target(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
    save_file({"input_ids": torch.tensor(prompt), "layer_inputs": torch.cat(layer_inputs).float().contiguous()}, path)
    return prompt


def draftsmith_proposal(drafter, target, prompt) -> tuple[list[int], torch.Tensor]:
    """draftsmith's greedy chain of DRAFT_TOKENS on `prompt` and its draft-vocabulary logits per step."""
    logits = []
    drafter.lm_head.register_forward_hook(
        lambda module, args, output: logits.append(output.reshape(-1, output.shape[-1]))
    )
    with torch.no_grad():
        state = prefill(target, [prompt], drafter.request).rows[0].draft_state()
        proposed = drafter.proposer().propose(state, DRAFT_TOKENS).tokens
    return proposed.tolist(), torch.cat(logits)[-DRAFT_TOKENS:].float()


@pytest.fixture(scope="module")
def speculators_read(speculators_python, small_data, token_cache, tmp_path_factory) -> dict[str, dict]:
    """Every case of this module, read by speculators in one process: for each export case (CASES) a
    drafter trained 2 steps and exported, for each window (WINDOWS) a checkpoint speculators builds (BUILD);
    then CHECK on each. name -> the case's recipe, target, prompt, speculators' findings and logits file
    (and for an export case its checkpoint)."""
    cases, jobs = {}, []
    for case, overrides in CASES.items():
        tmp = tmp_path_factory.mktemp(case)
        args = [
            "recipe=eagle3", "train.max_steps=2", "drafter.ttt_steps=2", f"data.train=[{small_data['train']}]",
            "data.eval=[]", f"data.cache_dir={token_cache}", "data.max_length=128", "train.save_every=0",
            "eval.enabled=false", f"output_dir={tmp / 'run'}", *overrides,
        ]  # fmt: skip
        final, target = train_in_process(args)
        recipe = load_recipe([*args, f"export.output={tmp / 'export'}"])
        cases[case] = {"recipe": recipe, "target": target, "final": final}
        jobs.append({"name": case, "folder": str(export_checkpoint(recipe, final)["vllm"]), "build": None})
    defaults = [f"drafter.{key}=true" for key in SPECULATORS_DEFAULTS]
    reference = load_target(load_recipe(["recipe=eagle3"]).target)  # the windows' target, loaded once
    for name, window in WINDOWS.items():
        tmp = tmp_path_factory.mktemp(name)
        recipe = load_recipe(["recipe=eagle3", *defaults, f"drafter.sliding_window={window}"])
        cases[name] = {"recipe": recipe, "target": reference}
        jobs.append({"name": name, "folder": str(tmp / "speculators"), "build": [str(REFERENCE_TARGET), window]})
    for job in jobs:
        case, tmp = cases[job["name"]], Path(job["folder"]).parent
        case["prompt"] = target_states(case["target"], case["recipe"], tmp / "states.safetensors")
        case["folder"], case["out"] = Path(job["folder"]), tmp / "speculators.safetensors"
        job.update(states=str(tmp / "states.safetensors"), out=str(case["out"]), gamma=DRAFT_TOKENS)
    features = tmp_path_factory.mktemp("features") / "data"
    cases[FEATURES] = {"folder": features, "info": speculators_features(features, token_cache, FEATURE_ROWS)}
    script = CHECK + BUILD + READ_FEATURES + RUN_JOBS
    done = subprocess.run(
        [speculators_python, "-c", script, json.dumps(jobs), str(features)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for name, findings in json.loads(done.stdout.strip().splitlines()[-1]).items():
        cases[name]["result"] = findings
    return cases


def assert_same_drafts(result: dict, ours: list[int], logits: torch.Tensor, out, case: str) -> None:
    """speculators' draft model, on the folder, proposed draftsmith's chain with the same logits."""
    assert result["attention"] == "sdpa" and len(ours) == DRAFT_TOKENS
    assert result["proposed"] == ours, result
    diff = (load_file(out)["logits"] - logits).abs().max().item()
    print(f"{case}: draft {ours}, logits max |diff| {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_speculators_loads_and_drafts_like_a_draftsmith_export(case, speculators_read):
    read = speculators_read[case]
    target, result = read["target"], read["result"]
    drafter = load_drafter(read["final"], TargetShape.of(target, read["recipe"].target.name_or_path), target).eval()
    ours, logits = draftsmith_proposal(drafter, target, read["prompt"])
    assert result["model"] == ("PEagleDraftModel" if case == "peagle" else "Eagle3DraftModel"), result
    assert result["not_loaded"] == [] and result["differ"] == [], result
    assert set(result["not_shipped"]) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, result
    assert result["embedding_sum"] > 0
    assert_same_drafts(result, ours, logits, read["out"], case)


@pytest.mark.parametrize("name", list(WINDOWS))
def test_draftsmith_evaluates_and_warm_starts_from_a_speculators_checkpoint(name, speculators_read):
    """The other direction: a checkpoint speculators itself saved (BUILD) is, through `open_drafter`
    (the eval's `checkpoint=`), a drafter proposing what speculators' own forward proposes on the same
    target states, and `warm_start` returns it with every tensor of the folder, to the bit.

    With a window narrower than the prompt, the first draft step attends to the last `window`
    positions on both sides, logits within 1e-4. Later steps differ by design: at depth i+1 speculators'
    training forward keeps the window of the root's position, vLLM's draft layer (and draftsmith's, in
    training and decoding) moves it with the draft's own position, so it drops i more of the oldest keys."""
    read, window = speculators_read[name], WINDOWS[name]
    recipe, target, folder, prompt, out = read["recipe"], read["target"], read["folder"], read["prompt"], read["out"]
    shape = TargetShape.of(target, recipe.target.name_or_path)
    drafter = open_drafter(folder, shape, target)
    assert drafter.config.aux_layers == [0, 1, 2] and drafter.pruned and drafter.config.sliding_window == window
    assert all(getattr(drafter.config, key) for key in SPECULATORS_DEFAULTS)
    ours, logits = draftsmith_proposal(drafter, target, prompt)
    if window >= len(prompt):
        assert_same_drafts(read["result"], ours, logits, out, "speculators checkpoint")
    else:
        first = (load_file(out)["logits"][0] - logits[0]).abs().max().item()
        print(f"window {window} of a {len(prompt)}-token prompt: first step's logits max |diff| {first:.2e}")
        assert read["result"]["proposed"][0] == ours[0] and first < 1e-4
        drafter.config.sliding_window = None  # the window is what makes them agree: without it they do not
        assert (draftsmith_proposal(drafter, target, prompt)[1][0] - logits[0]).abs().max().item() > 1e-3
        drafter.config.sliding_window = window
    saved = load_file(str(folder / "model.safetensors"))
    assert saved["fc.weight"].dtype == torch.bfloat16 and "verifier_lm_head.weight" not in saved
    recipe_drafter = drafter_class("eagle3").from_target(
        OmegaConf.to_object(recipe.drafter), target, recipe.target.name_or_path
    )
    start = warm_start(folder, recipe_drafter, target).state_dict()
    assert set(saved) - set(start) == {"embed_tokens.weight"} and set(start) <= set(saved)  # the target's embedding
    assert all(torch.equal(start[name], saved[name].to(start[name].dtype)) for name in start)
    recipe_drafter.load_state_dict(start)  # what the trainer does with it


def test_speculators_reads_draftsmiths_features(speculators_read):
    """speculators' ArrowDataset (its offline trainer's reader) reads every row of the features folder draftsmith
    wrote, the taps concatenated and the last state apart, split as its trainer splits them, with every loss-bearing
    token draftsmith counted."""
    from datasets import load_from_disk

    from draftsmith.data_prep.speculators_features import INFO

    read = speculators_read[FEATURES]
    result, rows = read["result"], load_from_disk(str(read["folder"]))
    assert result["rows"] == FEATURE_ROWS
    assert result["shapes"] == [[[n, 3 * 256], [n, 256]] for n in map(int, rows["seq_len"])]
    assert sum(result["masked"]) == read["info"]["masked_tokens"]
    assert json.loads((read["folder"] / INFO).read_text())["speculators_layer_ids"] == [1, 2, 3]
