"""draftsmith: train speculative-decoding drafters for a target LLM, evaluate them losslessly, export
them to serving engines, and retrain them when acceptance drifts.

This folder is the shared core every stage uses: the recipe parser (`recipe`), the one-line error
convention (`errors`), the frozen target and its shape (`target`), files bundled with the package
(`resources`), atomic writes and output-directory safety (`files`, `outputs`) and the command line (`cli`).
Stages talk to each other through files (conversations, feature shards, checkpoints, reports); the only
stage-to-stage imports are from `heads` (the drafter contract, which every stage reads checkpoints through),
`data_prep` (reading conversations) and `formats`, the engine formats' registry (each format's writer and reader,
and `formats.folder`, which reads a drafter folder of any of them: for eval, the monitor, the export's read-back and
a warm start).
"""
