"""LoRA settings shared by the drafters that train adapters with peft (draft_model, medusa2)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

ADAPTER_DIR = "adapter"  # peft's adapter format, written next to a checkpoint that trained adapters


@dataclass
class LoraSection:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    @classmethod
    def coerce(cls, value):
        """A config read back from a checkpoint's config.json holds the section as a plain dict."""
        return cls(**value) if isinstance(value, dict) else value

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules))
