"""Export a trained drafter to folders that serving engines load: one folder per engine, each a
complete Hugging Face-style repo (the engine's config.json, weights under the engine's names, the
target's tokenizer where the engine reads one, a model card, `draftsmith_export.json`), checked
against the target and the engine's loader before it lands, optionally loaded in the real engine
(vLLM) and compared with draftsmith's own eval, and optionally pushed to the Hub.

    python -m export recipe=NAME checkpoint=DIR export.engines=[vllm,sglang] export.output=DIR

This package is the command (export/run.py) and what it does around the folders: the model card,
the engine check, the load sweep, the γ choice, the batch schedule, the Hub push. The folders' formats,
one module per drafter kind, are a layer of their own below every stage (draftsmith.formats). Nothing is imported
here: `python -m export` and `-m export.sweep` set their Ctrl-C and SIGTERM handlers before torch's import.
"""
