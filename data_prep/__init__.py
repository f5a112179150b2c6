"""Conversations in, training-ready token ids and assistant-only loss masks out.

`conversations.load_conversations` reads and validates files or Hub data sets, `template.render_with_masks`
(`render_rows`) / `render_prompt` apply the target's chat template, `dataset.tokenize_conversations` builds the
cached tokenized data set, `collate.Collator` pads it into batches and `collate.PackingCollator` packs it into rows.
Nothing is imported here: each command of the package (`python -m data_prep.capture`, ...) sets its Ctrl-C and
SIGTERM handlers (draftsmith.errors.run_cli) before its modules' imports (torch's, datasets': seconds).
"""
