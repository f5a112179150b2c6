"""Conversations in, training-ready token ids and assistant-only loss masks out.

`load_conversations` reads and validates files or Hub data sets, `render_with_masks` (`render_rows`) /
`render_prompt` apply the target's chat template, `tokenize_conversations` builds the cached
tokenized data set, `Collator` pads it into batches and `PackingCollator` packs it into rows.
"""

from draftsmith.data_prep.collate import Collator, PackingCollator
from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import domain_names, load_tokenized, tokenize_conversations
from draftsmith.data_prep.template import render_prompt, render_rows, render_with_masks

__all__ = [
    "Collator",
    "PackingCollator",
    "domain_names",
    "load_conversations",
    "load_tokenized",
    "render_prompt",
    "render_rows",
    "render_with_masks",
    "tokenize_conversations",
]
