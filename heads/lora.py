"""LoRA settings shared by the drafters that train adapters with peft (draft_model, medusa2)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List

from draftsmith.errors import UserError

if TYPE_CHECKING:
    import torch

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

    def adapted(self, model: torch.nn.Module, what: str) -> torch.nn.Module:
        """`model` with peft's LoRA layers in the modules named target_modules (its base weights frozen). A name no
        module has would adapt nothing, unsaid by peft (DeepSeek-V3's latent attention has no k_proj, a
        mixture-of-experts target's experts no gate_proj): one name is a warning, all of them a refusal."""
        import torch  # here, not at the top: the recipe layer reads this section without torch
        from peft import LoraConfig, get_peft_model

        modules = dict(model.named_modules())
        absent = [key for key in self.target_modules if not any(n == key or n.endswith(f".{key}") for n in modules)]
        linear = sorted({n.rpartition(".")[2] for n, module in modules.items() if isinstance(module, torch.nn.Linear)})
        if len(absent) == len(self.target_modules):
            raise UserError(
                f"drafter.lora does not fit {what}: no module named {', '.join(absent)} (its linear layers: "
                f"{', '.join(linear)})"
            )
        if absent:
            logging.getLogger(__name__).warning(
                "drafter.lora.target_modules: %s %s no module of %s, so only %s get adapters (its linear layers: %s)",
                ", ".join(absent),
                "matches" if len(absent) == 1 else "match",
                what,
                ", ".join(name for name in self.target_modules if name not in absent),
                ", ".join(linear),
            )
        config = LoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules)
        )
        return get_peft_model(model, config)
