"""A randomly initialised model of SmolLM2-135M's exact shapes (its config and tokenizer, argv[1]) in
argv[2]: how fast draftsmith trains on the device, measured before the real target (which needs two
transfers) is there."""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

source, output = Path(sys.argv[1]), Path(sys.argv[2])
output.mkdir(parents=True, exist_ok=True)
for path in source.iterdir():
    shutil.copy(path, output / path.name)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32).save_pretrained(output)
print("probe target", output, sorted(path.name for path in output.iterdir()))
