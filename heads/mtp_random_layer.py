"""A random MTP layer in a target folder's checkpoint, as its release ships one: a tiny stand-in for a released
checkpoint's (tests, benchmarks and the demo; heads/mtp.py's drafter writes it under the release's names).

    python -m draftsmith.heads.mtp_random_layer DIRECTORY [--seed N]

gives a target `python -m draftsmith.random_target` wrote (transformers saves no MTP layer) a random first one, ready
for `recipe=mtp target.name_or_path=DIRECTORY`.
"""

from __future__ import annotations

if __name__ == "__main__":  # run before the imports below (torch's: seconds), which the command makes under run_cli
    import importlib

    from draftsmith.errors import run_cli

    # the command is this module by its installed name: nothing below runs in this copy
    run_cli(lambda argv: importlib.import_module("draftsmith.heads.mtp_random_layer").write_command(argv))

import json
import stat
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.files import save_safetensors
from draftsmith.heads import mtp_depths
from draftsmith.heads.base import WEIGHTS_NAME
from draftsmith.heads.mtp import Mtp, text_fields
from draftsmith.heads.mtp_config import MtpConfig
from draftsmith.heads.mtp_family import decoder_layers
from draftsmith.heads.mtp_layer import count_holder
from draftsmith.heads.mtp_layouts import LAYOUTS, MTP_FIELDS
from draftsmith.model_files import TRANSFORMERS_LAYERS
from draftsmith.target import load_target


@torch.no_grad()
def write_random_layer(directory: str | Path, std: float = 0.08, seed: int = 0, block: Optional[dict] = None) -> None:
    """Give a target folder written by draftsmith.random_target a random first MTP layer, in its
    architecture's checkpoint layout, and the config key counting it: a tiny stand-in for a released
    checkpoint's (tests and benchmarks; every >= 2-D weight from N(0, std²), norms as the family builds them).
    `block`: fields over the count holder's (several depths, a count-block layout's without a chain norm)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.causal_lm import wraps_a_text_model

    directory = Path(directory)
    config_path = directory / "config.json"
    values = json.loads(config_path.read_text())
    architecture = (values.get("architectures") or ["?"])[0]
    if architecture not in LAYOUTS:
        raise UserError(f"no MTP layer layout is known for a {architecture} target")
    layout = LAYOUTS[architecture]
    text = text_fields(values)
    fields = count_holder(values, layout)  # a wrapper's in its text_config, as its releases keep it
    fields[layout.count_key] = 1
    if layout.count_block:  # a release's block in the form draftsmith trains (a chain norm, depth 0 as given), its
        # fields where transformers reads them too, as it copies them at load
        fields |= {"chain_hidden_post_norm": True, "local_layer_ids": fields.get("local_layer_ids") or []}
    fields |= block or {}  # several depths: a layer each under its release names (heads/mtp_depths.py)
    text |= {ours: fields[theirs] for theirs, ours in MTP_FIELDS} if layout.count_block else {}
    config_path.write_text(json.dumps(values, indent=2) + "\n")
    if wraps_a_text_model(values):  # its language model and lm_head, as draftsmith loads it
        target = load_target(str(directory))
    else:
        target = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **TRANSFORMERS_LAYERS)
    torch.manual_seed(seed)
    # named apart from the folder, whose weights do not hold the layer yet (MtpConfig.check reads them)
    drafter = Mtp.unloaded(MtpConfig(mtp_depths=int(fields[layout.count_key])), target, "random MTP layer")
    with torch.random.fork_rng():  # the draws below as before, for the families this touches nothing of
        for module in drafter.modules():
            # a layer built alone leaves what its family's own initialisation sets uninitialised (torch.empty:
            # attention sinks, hyper-connection biases and scales); its weights and biases it sets itself
            if any(name not in ("weight", "bias") for name, _ in module.named_parameters(recurse=False)):
                target.get_decoder()._init_weights(module)  # the family's (a TextOfWrapper's own is generic)
    for parameter in drafter.parameters():
        if parameter.dim() >= 2:
            parameter.normal_(0.0, std)
    weights = directory / WEIGHTS_NAME
    tensors = load_file(str(weights))
    layers = decoder_layers(text)
    written = drafter.checkpoint_tensors().items()
    tensors |= {mtp_depths.release_name(layout, name, layers): t.contiguous() for name, t in written}
    mode = stat.S_IMODE(weights.stat().st_mode)  # safetensors writes a private file (0600) in the file's place
    save_safetensors(tensors, weights, metadata={"format": "pt"})
    weights.chmod(mode)


def write_command(argv: list[str]) -> None:
    """Give the target folder the arguments name a random first MTP layer (`write_random_layer`; its path alone on
    stdout)."""
    from draftsmith.cli import OneLineArguments, configure_logging

    configure_logging()
    parser = OneLineArguments(prog="python -m draftsmith.heads.mtp_random_layer", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a target folder python -m draftsmith.random_target wrote")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (Path(args.directory) / "config.json").is_file() or not (Path(args.directory) / WEIGHTS_NAME).is_file():
        raise UserError(f"DIRECTORY {args.directory!r} holds no target written by python -m draftsmith.random_target")
    write_random_layer(args.directory, seed=args.seed)
    print(args.directory)
