"""EAGLE-1 (with EAGLE-2's dynamic draft tree at decode time): a small autoregressive model over the
target's features.

Draft position t reads the target's post-norm last hidden state f_t (the lm_head input, EAGLE's
`hidden_states[-1]`) and the embedding of the *next* token x_{t+1}:

    f̂_{t+1} = layers(fc(cat(embed(x_{t+1}), f_t)))      layers: decoder layers of the target's family

and the target's own lm_head turns f̂_{t+1} into a guess of x_{t+2}. At decode time the drafter keeps
its own KV cache over (token, feature) pairs: committed positions carry the target's features, draft
positions its own predictions, which is how it runs several steps ahead.

The token embedding and the lm_head are the target's, frozen, and not part of the checkpoint
(vLLM and SGLang share them with the target too); `attach_target` re-attaches them after loading.
What EAGLE-1 and EAGLE-3 (heads/eagle3.py) share is `EagleBase`; their decoding side, the drafter's
own KV cache over the committed sequence with the greedy chain and EAGLE-2's dynamic tree grown from
it, is `EagleProposer` (both in heads/eagle_base.py).

Parameter names are those of vLLM's/SGLang's EAGLE-1 loaders (`fc.weight|bias`, `layers.{i}.*`,
no `layers.0.input_layernorm`), so export is at most a prefix rename; vLLM's loader has no fc bias
(`fc_bias: false` for a checkpoint meant for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads import register
from draftsmith.heads.base import per_sample_stats
from draftsmith.heads.eagle_base import EagleBase, import_qualified
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.packing import (
    conversation_rand,
    documents,
    draft_attention_mask,
    num_documents,
    positions,
    same_document,
)
from draftsmith.heads.proposer import DraftState
from draftsmith.heads.vocab_loss import chunk_rows_for, soft_cross_entropy
from draftsmith.target import FeatureRequest, TargetOutput, TargetShape

if TYPE_CHECKING:
    from transformers import DynamicCache


@register
class Eagle(EagleBase):
    type = "eagle"
    TITLE = "EAGLE-1"
    Config = EagleConfig

    def __init__(self, config: EagleConfig, target: TargetShape):
        super().__init__(config, target)
        layer_cls = import_qualified(config.decoder["layer"])
        hidden = target.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(layer_cls(self.layer_config, layer_idx=i) for i in range(config.num_layers))
        # EAGLE feeds fc's output to the first layer unnormalised (vLLM: disable_input_layernorm).
        self.layers[0].input_layernorm = nn.Identity()

    @classmethod
    def features(cls, config: EagleConfig, target: TargetShape) -> FeatureRequest:
        return FeatureRequest(final=True, logits=True)

    # -- the draft model ------------------------------------------------------------------------
    def draft(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        cache: Optional[DynamicCache] = None,
    ) -> torch.Tensor:
        """EAGLE-1: f̂_{p+1} = layers(fc(cat(embed(x_{p+1}), f_p))) (see EagleBase.draft)."""
        hidden = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], dim=-1))
        rope = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, position_embeddings=rope)
        return hidden

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        _, lm_head = self.target_modules()
        return lm_head(features.to(lm_head.weight.dtype)).float()

    def top_tokens(self, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Clamped so that rounding never lets a child outscore its parent (see `grow`).
        best = self.logits(feature).log_softmax(-1).clamp(max=0).topk(k)
        return best.values, best.indices

    def committed_features(self, state: DraftState) -> Optional[torch.Tensor]:
        return None if state.new_final is None else state.new_final.to(self.fc.weight.dtype)

    # -- training -------------------------------------------------------------------------------
    def loss(self, batch: dict, target_out: TargetOutput):
        """EAGLE's loss, teacher-forced on the target's features of the same forward.

        Alignment, with x_t = input_ids[:, t] and f_t = target_out.final[:, t] (f_t is what the target
        reads to predict x_{t+1}): draft position t reads (embed(x_{t+1}), f_t) and predicts f_{t+1},
        whose lm_head output is a guess of x_{t+2}. So for t in [0, T-2): tokens input_ids[:, 1:-1],
        features final[:, :-2], regression target final[:, 1:-1], soft labels the target's
        distribution logits[:, 1:-1] (of x_{t+2}), and position t counts where x_{t+2} is
        supervised: loss_mask[:, 2:]. (EAGLE #317 and SpecForge #885 were off-by-ones here.)

        Packed rows: attention is block-diagonal per document and positions restart, and t counts
        only where x_{t+2} is in t's document. The last position of a document reads the next
        document's first token, but nothing in its own document attends to it and it is not scored.
        """
        dtype = self.fc.weight.dtype
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        length = input_ids.shape[1]
        docs = documents(batch)
        final = target_out.final.to(dtype)
        features = final[:, :-2]
        if self.training and self.config.noise_std > 0:
            # EAGLE's uniform noise, (rand - 0.5) * std, without its as-coded extra factor
            # 512 / seq_len, which makes the amplitude depend on the padded batch length; each conversation's own
            draws = conversation_rand(batch, features.shape[-1:], features.device, self.optimizer_step)[:, :-2]
            features = features + ((draws - 0.5) * self.config.noise_std).to(features.dtype)
        predicted = self.draft(
            input_ids[:, 1:-1], features, positions(batch)[:, :-2], draft_attention_mask(batch, length - 2)
        )

        # Every position runs, weighted by whether it is scored: no shape depends on the data, so nothing waits
        # for the host on an accelerator, and the fused vocabulary loss (heads/vocab_loss.py) holds
        # `loss_chunk_bytes` of logits at a time.
        mask = loss_mask[:, 2:] & same_document(docs, 2)
        feature_loss = F.smooth_l1_loss(predicted.float(), final[:, 1:-1].float(), reduction="none").mean(-1) * mask
        # The target's distribution of x_{t+2} (its logits at t+1): row i of the flattened [B, T-2] positions is
        # b * (T-2) + t, its target row b * T + t + 1.
        width = length - 2
        target_best = torch.full((mask.numel(),), -1, dtype=torch.long, device=mask.device)

        def teacher(rows: torch.Tensor) -> torch.Tensor:
            logits = target_out.logits_at(rows // width * length + rows % width + 1).float()
            target_best[rows] = logits.argmax(-1)
            return logits.softmax(-1)

        weight = self.target_modules()[1].weight  # the target's lm_head, frozen
        chunk_rows = chunk_rows_for(self.loss_chunk_bytes, self.target.vocab_size)
        outputs = predicted.flatten(0, 1).to(weight.dtype)
        result = soft_cross_entropy(outputs, weight, teacher, mask.flatten().float(), chunk_rows)
        # Sums over the scored positions; the trainer divides by loss_tokens (heads/base.py, "The loss contract").
        total = self.config.feature_loss_weight * feature_loss.sum() + self.config.token_loss_weight * result.loss

        with torch.no_grad():
            guess = result.best.view_as(mask)
            values = {
                "feature_loss": feature_loss.detach(),
                "token_loss": result.token_loss.view_as(mask),
                # agreement with the target's greedy token: greedy acceptance of the first draft token
                "step1/top1": (guess == target_best.view_as(mask)).float(),
                "step1/top1_data": (guess == input_ids[:, 2:]).float(),  # the data's next token
            }
        samples = docs[:, :-2].clamp(min=0)  # padding is never scored
        return total, self.loss_tokens(batch), per_sample_stats(values, samples, num_documents(batch), where=mask)
