"""EAGLE-3's training: the training-time test (`unroll`, every draft step at every position, fixed-shape)
and its loss against the target's distribution over the draft vocabulary (`Teacher`). Apart from the draft
model these steps run (heads/eagle3.py's `Eagle3`, which takes them in as `Eagle3Training`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from draftsmith.heads.base import per_sample_stats
from draftsmith.heads.packing import documents, draft_attention_mask, num_documents, positions, shifted
from draftsmith.heads.ttt_attention import (
    DenseMasks,
    FlexLayout,
    StepKeys,
    TTTStep,
    resolved_backend,
    unrunnable_backend,
)
from draftsmith.heads.vocab_loss import chunk_rows_for, soft_cross_entropy
from draftsmith.target import TargetOutput


class Eagle3Training:
    """The training side of `Eagle3` (heads/eagle3.py), on the draft model it defines (`draft`, `fuse`,
    `mask_inputs`, `lm_input`, `draft_ids`)."""

    def untrainable_on(self, device: torch.device) -> Optional[str]:
        return unrunnable_backend(self.config.ttt_attention, device, self.layers[0].self_attn.head_dim, training=True)

    def unroll(
        self, input_ids: torch.Tensor, layers: dict[int, torch.Tensor], batch: Optional[dict] = None
    ) -> list[torch.Tensor]:
        """Training-time test: the output features [B, T-2, H] of draft steps 0..ttt_steps-1.

        Alignment, with x_t = input_ids[:, t] and h_t the target's states at t (what it reads to
        predict x_{t+1}): at step 0, draft position t reads (x_{t+1}, fuse(h_t)), exactly the cache
        entry t of decoding, and its output guesses x_{t+2}. Step i > 0 at position t reads
        (x_{t+1+i}, step i-1's output at t) at RoPE position t+i and guesses x_{t+2+i}: it is the
        draft at depth i+1 after committing x_0..x_{t+1}, with the earlier drafts teacher-forced to
        the data. Its attention sees step 0's keys at positions <= t (the committed entries; with a
        sliding window only those > t+i - window, vLLM's window at depth i+1) and steps 1..i's keys at
        t (its ancestors and itself), the decode-time tree mask (heads/ttt_attention.py). Every step
        runs at every position, so no shape depends on the data; positions past the sequence's end
        read a pad token and the loss does not score them.

        `batch` (optional, the training batch) makes it packing-aware: RoPE positions restart per
        document and step 0's keys are seen only within a document. A position near a document's
        end reads the next document's tokens at later steps, exactly as one near a row's end reads
        padding: it is never scored (`loss`), and only its own later steps read it.
        """
        batch = {"input_ids": input_ids} if batch is None else batch
        rows, width = input_ids.shape[0], input_ids.shape[1] - 2
        window = self.config.sliding_window
        start, mask = positions(batch)[:, :width], draft_attention_mask(batch, width, window)
        backend = resolved_backend(self.config.ttt_attention, input_ids.device, self.layers[0].self_attn.head_dim)
        # What every step shares is built once: the backend's masks, each step's RoPE, P-EAGLE's mask inputs
        layout = masks = None
        if backend == "flex":  # segments: the rows, or with a mask its documents (padding one per row)
            segments = documents(batch)[:, :width] if mask is not None else start.new_zeros(start.shape)
            layout = FlexLayout(segments, start, window, self.config.ttt_steps)
        else:
            masks = DenseMasks(start, mask, window)
        fused = self.fuse(layers)[:, :width]  # step 0's input features
        ropes = self.step_ropes(fused, start)
        if self.config.parallel_drafting:  # every later query reads the mask, never an earlier guess
            tokens, features = self.mask_inputs(rows * width, input_ids.device)
            masked = tokens.view(rows, width), features.reshape(rows, width, -1)
        cache = StepKeys()  # step i's attention reads the keys of step 0 and of each position's steps 1..i
        outputs = [self.draft(shifted(input_ids, 1, width), fused, start, mask, cache=cache, rope=ropes[0])]
        for step in range(1, self.config.ttt_steps):
            if self.config.parallel_drafting:
                tokens, features = masked
            else:
                tokens, features = shifted(input_ids, 1 + step, width), outputs[-1]
            ttt_step = TTTStep(backend, masks=masks, layout=layout, step=step)
            outputs.append(self.draft(tokens, features, start + step, cache=cache, rope=ropes[step], ttt_step=ttt_step))
        return outputs

    def step_ropes(self, features: torch.Tensor, start: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """RoPE's (cos, sin) [B, W, d] at every step's positions start + i, from one call over all of them: the
        draft layers' RoPE kinds (families.PORTABLE_ROPE) have fixed frequencies and treat each row alone, so
        these are the values a call per step gives. `features` gives the dtype and device."""
        steps = self.config.ttt_steps
        cos, sin = self.rotary_emb(features, torch.cat([start + step for step in range(steps)]))
        return list(zip(cos.chunk(steps), sin.chunk(steps)))

    def loss(self, batch: dict, target_out: TargetOutput):
        """Soft cross-entropy to the target's distribution, summed over the TTT steps with weights
        ttt_decay**i (see `unroll` for the alignment).

        Step i at position t is scored against the target's distribution of x_{t+2+i} (its logits at
        t+1+i) where x_{t+2+i} bears loss (loss_mask[:, t+2+i]) and is in t's document. The target's
        distribution is restricted to the draft vocabulary and renormalised there (EAGLE-3's
        softmax(logits[t2d])), and positions whose target argmax lies outside the draft vocabulary are
        left out of the loss (EAGLE-3's position mask: no draft token can be accepted there at T=0).
        The loss is the sum over steps i of ttt_decay**i x step i's token losses summed over the
        positions it scores, normalised by the trainer with `loss_tokens` (the batch's supervised
        tokens, heads/base.py "The loss contract"): a left-out position adds nothing to the sum and
        still counts in the normaliser, so a pruned vocabulary's uncovered positions weigh as tokens
        the draft cannot win.

        Every step scores all positions with a weight (0 where it does not score), through the fused
        vocabulary loss (heads/vocab_loss.py), in chunks of `loss_chunk_bytes`: no shape depends on
        the data, so nothing here waits for the host.

        Metrics: `step{i+1}/top1`, the draft's argmax (in target ids) equal to the target's argmax at
        every supervised position, an out-of-vocabulary argmax counting as a miss; teacher-forced,
        i.e. acceptance at depth i+1 given depths 1..i were the data's tokens. `step{i+1}/loss` per
        step, and `vocab_coverage` (share of supervised positions whose target argmax is in the draft
        vocabulary: the ceiling of step1/top1) when the vocabulary is pruned.
        """
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        rows, width = input_ids.shape[0], input_ids.shape[1] - 2
        docs, num_docs = documents(batch), num_documents(batch)
        samples = docs[:, :width].clamp(min=0)  # position t's document (padding is never scored)
        teacher = self.teacher(target_out, input_ids.shape)
        draft_ids = self.draft_ids()
        chunk = chunk_rows_for(self.loss_chunk_bytes, self.config.draft_vocab_size)
        outputs = self.unroll(input_ids, target_out.layers, batch)
        steps = len(outputs)
        # [S, B, W], step i's position t at t + 2 + i: every step's masks at once (few operators for the host to issue)
        ahead = step_windows(docs, 2, steps, width, fill=-1)
        supervised = step_windows(loss_mask, 2, steps, width, fill=False) & (docs[:, :width] == ahead) & (ahead >= 0)
        scored = supervised & step_windows(teacher.in_vocab, 1, steps, width, fill=False)
        decay = self.config.ttt_decay ** torch.arange(steps, dtype=torch.float64, device=input_ids.device)
        weights = scored.float() * decay.float()[:, None, None]
        # Every step's rows in one fused call: one float32 lm_head gradient for the whole unroll (and one norm)
        features = self.lm_input(torch.cat([output.flatten(0, 1) for output in outputs]))
        result = soft_cross_entropy(features, self.lm_head.weight, teacher.rows(width, steps), weights.flatten(), chunk)
        with torch.no_grad():
            best = draft_ids[result.best.clamp(min=0)].view(steps, rows, width)  # -1: not scored
            hits = scored & (best == step_windows(teacher.best, 1, steps, width, fill=-1))
            token_loss = result.token_loss.view(steps, rows, width)
            per_step = per_sample_stats({"top1": hits}, samples, num_docs, where=supervised)  # [S, D, 2] each
            per_step |= per_sample_stats({"loss": token_loss}, samples, num_docs, where=scored)
            stats: dict[str, torch.Tensor] = {}
            for step in range(steps):
                stats |= {f"step{step + 1}/{name}": pairs[step] for name, pairs in per_step.items()}
                if step == 0 and self.pruned:
                    stats |= per_sample_stats({"vocab_coverage": scored[0]}, samples, num_docs, where=supervised[0])
        return result.loss, self.loss_tokens(batch), stats

    @torch.no_grad()
    def teacher(self, target_out: TargetOutput, shape: torch.Size) -> Teacher:
        """The target's side of the loss, once for every step: at every position of the [B, T] batch
        its argmax over its whole vocabulary, whether that is a draft token, and its distribution
        restricted to the draft vocabulary and renormalised there (EAGLE-3's softmax(logits[t2d])), zero
        where the argmax is not a draft token (a captured top-k row may be all -inf there). The logits
        are read `loss_chunk_bytes` of full-vocabulary rows at a time (`TargetOutput.logits_at`, from the
        final hidden state when the target runs live)."""
        draft_ids = self.draft_ids()
        device = draft_ids.device
        positions = shape[0] * shape[1]
        index = torch.arange(positions, device=device)
        best = torch.empty(positions, dtype=torch.long, device=device)
        probs = torch.empty(positions, len(draft_ids), dtype=torch.float32, device=device)  # filled in place
        step = chunk_rows_for(self.loss_chunk_bytes, self.target.vocab_size)
        for start in range(0, positions, step):
            logits = target_out.logits_at(index[start : start + step])
            best[start : start + step] = logits.max(-1).indices  # argmax (the first maximum)
            probs[start : start + step] = (logits[:, draft_ids] if self.pruned else logits).float().softmax(-1)
        in_vocab = self.t2d[best] if self.pruned else torch.ones_like(best, dtype=torch.bool)
        probs.masked_fill_(~in_vocab[:, None], 0.0)
        return Teacher(best.view(shape), in_vocab.view(shape), probs)


def step_windows(x: torch.Tensor, first: int, steps: int, width: int, fill) -> torch.Tensor:
    """[steps, B, width]: step i's window x[:, first + i : first + i + width] of the [B, T] `x`, padded with `fill`
    past its end; one operator (the pad) where `shifted` once a step takes up to two, the windows views of it."""
    missing = first + steps - 1 + width - x.shape[1]
    padded = torch.nn.functional.pad(x, (0, missing), value=fill) if missing > 0 else x
    return padded.unfold(1, width, 1)[:, first : first + steps].transpose(0, 1)


@dataclass
class Teacher:
    """The target's side of EAGLE-3's loss over a [B, T] batch (`Eagle3Training.teacher`)."""

    best: torch.Tensor  # [B, T] long: the target's argmax over its whole vocabulary
    in_vocab: torch.Tensor  # [B, T] bool: whether that argmax is a draft token
    probs: torch.Tensor  # [B * T, draft vocab] float32: its distribution over the draft vocabulary (0: not in it)

    def rows(self, width: int, steps: int):
        """The teacher of the whole unroll for the fused loss: rows of the steps' flattened [S, B, W]
        positions (W = T - 2) -> the distributions they are scored against, step i's position t against
        the one at t + 1 + i (a position past the row reads the batch's first: it is never scored). The
        row each reads is worked out once for every chunk: a chunk then costs one gather."""
        rows, length = self.best.shape
        places = torch.arange(rows * length, device=self.best.device).view(rows, length)
        source = step_windows(places, 1, steps, width, fill=0).flatten()
        return lambda index: self.probs.index_select(0, source[index])
