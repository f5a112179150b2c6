"""LoRA settings shared by the drafters that train adapters with peft (draft_model, medusa2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from draftsmith.errors import UserError

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

    def check(self) -> None:
        if self.r < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.target_modules:
            raise UserError(f"drafter.lora needs r >= 1, alpha > 0, 0 <= dropout < 1 and target_modules (got {self})")

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules)
        )
