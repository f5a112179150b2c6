"""The recipe's typed schema: one dataclass per section, each key with its type, default and (as the
comment beside it) its description, which `--help` and docs/recipe.md are generated from
(draftsmith/recipe_keys.py). The drafter section's schema is the drafter type's own config class
(heads registry). draftsmith/recipe.py composes and validates recipes against it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from draftsmith.engines import PROMPT_LOOKUP_MAX, VLLM_FORMATS


@dataclass
class TargetSection:
    """The model the drafter is trained for and verified by."""

    name_or_path: str = MISSING  # local directory or Hub id
    revision: Optional[str] = None  # a Hub branch, tag or commit of name_or_path
    # A GGUF file inside name_or_path (or an absolute path): dequantized once into a cached
    # transformers directory, which then replaces name_or_path (see draftsmith.gguf).
    gguf_file: Optional[str] = None
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    trust_remote_code: bool = False  # run the model repository's own Python code (off: only transformers' classes)
    # none: every rank holds the whole target | fsdp: its decoder layers sharded over the ranks of
    # train, capture and regenerate (FSDP2; embedding and lm_head stay whole), for targets too big
    # for one device (draftsmith.sharding). Eval and export load the target whole either way.
    shard: str = "none"


@dataclass
class VllmEngineSection:
    """How a data stage runs vLLM (data.regenerate.engine=vllm, data.capture.engine=vllm; passed to vLLM's `LLM`)."""

    # a Python with vLLM installed (its own environment; a bare name is looked up on PATH, a path read from the
    # current directory); default this one
    python: Optional[str] = None
    # the target's weights as vLLM runs them: auto = as the trainer loads the target (target.dtype, whose auto is
    # float32 on CPU, bfloat16 on a GPU), not vLLM's own auto; the stage's record names the one that ran
    dtype: str = "auto"
    # GPUs per engine; N processes (accelerate launch / torchrun) run N engines on their own GPUs
    tensor_parallel_size: int = 1
    gpu_memory_utilization: Optional[float] = None  # default 0.9 with a GPU, 0.3 without (then it is host memory)
    enforce_eager: Optional[bool] = None  # default: on without a GPU (no graphs to capture on CPU)
    max_num_seqs: int = 256  # sequences decoded together


@dataclass
class CaptureSection:
    """`python -m data_prep.capture`: what to store from the target's forward over data.train.
    None means "what the recipe's drafter asks for" (its `features`)."""

    output: Optional[str] = None  # shard directory; default <output_dir>/features
    layers: Optional[List[int]] = None  # decoder-layer outputs (draftsmith.target's convention; -1 = embeddings)
    final: Optional[bool] = None  # last hidden state after the final norm
    logits: str = "auto"  # auto (topk if the drafter asks for logits, else none) | none | topk | full
    topk: int = 32  # entries kept per token when logits=topk
    dtype: str = "bfloat16"  # bfloat16 | float16 | float8 (e4m3 with a float32 scale per token)
    shard_tokens: int = 65536  # tokens per shard, approximately (shards hold whole conversations)
    # transformers (the target in this process, as training runs it) | vllm (the target in a vLLM engine, see `vllm`:
    # the states vLLM serves the drafter with, sharded by vLLM, the target never loaded here; layers, final and the
    # top-k, no logits=full)
    engine: str = "transformers"
    vllm: VllmEngineSection = field(default_factory=VllmEngineSection)


@dataclass
class RegenerateSection:
    """`python -m data_prep.regenerate`: data.train with every assistant turn rewritten by the target."""

    output: Optional[str] = None  # directory of part files; default <output_dir>/regenerated
    # transformers (model.generate, left-padded batches) | vllm (continuous batching, see `vllm`)
    engine: str = "transformers"
    max_new_tokens: int = 256  # per assistant turn
    # assistant turns answered per conversation, the rest of it dropped (None: all); 1 = first turns only,
    # as MT-bench scores them (more distinct prompts for the same generation time)
    max_turns: Optional[int] = None
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    batch_size: int = 8  # conversations per part file, generated together (vllm: use hundreds)
    seed: int = 0  # sampling seed (temperature > 0)
    # answers written per conversation, each its own seeded draw (needs temperature > 0; at most 1000): more of
    # the target's answers to the same prompts
    samples: int = 1
    # conversations with fewer assistant turns answered (as given, or once data.max_length cuts them) are not
    # written; 2 (with max_turns null): the later turns of conversations whose first turns a max_turns=1
    # regeneration holds already (see reuse)
    min_turns: int = 1
    # earlier regenerations (directories) by this target with the same answer settings (greedy): a turn whose
    # prompt, the conversation so far, one of them answered takes that answer instead of a new generation
    reuse: List[str] = field(default_factory=list)
    # held-out conversations (files, directories): a data.train conversation whose first user turn is one of
    # theirs is not regenerated, so no record written holds a held-out prompt
    exclude: List[str] = field(default_factory=list)
    vllm: VllmEngineSection = field(default_factory=VllmEngineSection)


@dataclass
class DataSection:
    """Conversations (`messages` of role/content; optional `domain`) and how they are tokenized."""

    train: List[str] = field(default_factory=list)  # files (.jsonl, .jsonl.gz, .json, .parquet), globs or Hub ids
    # held-out conversations with answers: eval-split accuracy, and the eval's prompts (prompts alone: eval.data)
    eval: List[str] = field(default_factory=list)
    max_length: int = 1024  # tokens per conversation after the chat template
    overlong: str = "truncate"  # truncate | drop | error
    # cap per source file (data.train's and data.eval's: the first N of a file, whatever their domains), for quick runs
    max_conversations: Optional[int] = None
    # a record of a JSON-lines file whose line is not valid UTF-8 (traffic logs hold such bytes): false = stop
    # with one line naming the file and line; true = leave it out and log how many were left out, per file
    skip_invalid_utf8: bool = False
    # an assistant turn's reasoning (its `thinking`, `reasoning_content` or `reasoning`, as the target's chat
    # template renders it): train | mask (left out of the loss, found verbatim in the turn; the markup around it is
    # still trained); either way a template that renders no reasoning is refused
    thinking: str = "train"
    cache_dir: Optional[str] = None  # tokenized-data cache; default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith
    # Conversations whose assistant tokens pick a pruned draft vocabulary (EAGLE-3) instead of data.train's:
    # raw text of the same traffic counts tokens as well as expensive regenerated answers do, and more of it
    # ranks more of a large vocabulary (tokens never seen tie, and fall to the lowest ids).
    draft_vocab: Optional[List[str]] = None
    features: Optional[str] = None  # a data_prep.capture directory to train from instead of running the target
    # Sequence packing: each micro-batch's conversations laid end to end in rows of pack_length tokens
    # (default max_length), attention and positions per conversation; same losses, fewer rows. Not always less
    # padding: every packed row is padded to the micro-batch's fullest one.
    pack: bool = False
    pack_length: Optional[int] = None  # tokens per packed row; default data.max_length
    capture: CaptureSection = field(default_factory=CaptureSection)
    regenerate: RegenerateSection = field(default_factory=RegenerateSection)


@dataclass
class TrainSection:
    """`train.py`: the training loop (trainer/loop.py) and its checkpoints."""

    lr: float = 1e-3  # peak learning rate (linear warm-up, then cosine decay to zero)
    # adamw | muon: Muon on the hidden layers' weight matrices, AdamW on norms, biases, embeddings and
    # output heads, one lr for both (trainer/optim.py); not under DeepSpeed
    optimizer: str = "adamw"
    max_steps: int = -1  # optimizer steps; -1 means run `epochs` epochs
    epochs: int = 1  # passes over data.train, read when max_steps is -1 (another value with max_steps is refused)
    micro_batch_size: int = 8  # conversations per process per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    # optimizer steps of linear learning-rate warm-up from 0: step 1 trains at lr 0 (as in transformers' schedule
    # and HF Trainer), step warmup_steps + 1 at train.lr; the log's train/lr is the rate the logged step trained at
    warmup_steps: int = 0
    weight_decay: float = 0.0  # weight decay (AdamW's, and Muon's with train.optimizer=muon)
    adam_betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    max_grad_norm: float = 1.0  # gradient clipping (global norm)
    seed: int = 0  # initialisation and data order
    log_every: int = 10  # optimizer steps between logged rows (log.jsonl, TensorBoard, the progress line's loss)
    save_every: int = 0  # steps between checkpoints; 0 = only the final one
    keep_checkpoints: int = 2  # the newest step checkpoints kept, older ones deleted; 0 = keep every one
    # true = the newest checkpoint in output_dir | latest_intact = the newest whose files match the checksums
    # recorded when it was saved (a damaged one is refused otherwise) | a checkpoint path | false (or null) = a new
    # run; any other value is refused
    resume: Optional[str] = None
    overwrite: bool = False  # start over in an output_dir that holds another run: the earlier run is moved aside
    # warm start: the drafter whose weights and draft vocabulary training starts from (a draftsmith checkpoint,
    # an export's engine folder or one speculators saved; its architecture must be the recipe's drafter section's).
    # A resumed run continues from its checkpoint and keeps the start it began from (its recipe.yaml's): another
    # train.init_from with train.resume is not read (a warning says so).
    init_from: Optional[str] = None
    max_nonfinite: int = 10  # optimizer steps skipped for a non-finite loss/gradient before the run stops
    # auto: what accelerate launch was told (the bundled configs say bf16, applied on a CPU too), else bf16 where
    # the GPU supports it, else none | no | bf16 | fp16. The run logs the one used, its recipe.yaml records it
    # and a resume in another is refused.
    mixed_precision: str = "auto"
    num_workers: int = 0  # DataLoader worker processes
    # the device's peak FLOP/s in TFLOP/s, per process, for train/mfu in the log (trainer/observe.py): e.g. 989 for
    # an H100 SXM's dense bf16 tensor cores; null = MFU not reported (draftsmith never guesses a device's peak)
    peak_tflops: Optional[float] = None
    # [first, last]: torch.profiler over optimizer steps first..last (1-based, at most 20 steps), a Chrome trace
    # written to output_dir/profile/ (trainer/observe.py); null = no profiling
    profile_steps: Optional[List[int]] = None
    # MiB of [rows, vocabulary] float32 logits a vocabulary loss holds at once (heads/vocab_loss.py: every kind's
    # but DFlash's, the draft model's and Medusa-2's divergences too); larger chunks mean fewer, bigger GEMMs
    vocab_chunk_mb: int = 256
    # the fused vocabulary loss's chunk math past the lm_head GEMM (argmax, log-softmax, the loss, its gradient)
    # as one torch.compile graph for every chunk size (heads/vocab_loss.py `compiled_chunk_math`): fewer passes
    # over the chunk's [rows, vocabulary] float32 values, a compile of a few seconds per variant at the start; the
    # kinds whose loss is the cross-entropy to the target's distribution or tokens (not the draft model's or
    # Medusa-2's divergences); losses equal to the eager math's within float32 rounding. On an H200 it made
    # Qwen3-0.6B's 3-step EAGLE-3 step 1.46x faster (docs/performance.md)
    compile_vocab_loss: bool = False
    # each of the frozen target's decoder layers under torch.compile for its forward in training (draftsmith/
    # compiled_layers.py): its norms, rotary embedding and activations fused, several times fewer kernel launches;
    # one set of graphs for the layers of one class, shapes dynamic after a second width, a recompile limit that
    # raises rather than falls back; a compile of seconds at the start. Not with data.features (no target runs).
    # On an H200 it halved the target's forward and made SmolLM2's EAGLE-3 step 1.47x faster (docs/performance.md)
    compile_target: bool = False
    # the drafter's repeated blocks under torch.compile, forward and backward (draftsmith/compiled_layers.py): EAGLE-3's
    # draft layer, once per training-time-test step, its attention included; a few graphs per step kind, width and
    # grad mode, a recompile limit that raises rather than falls back, a compile of seconds (a GPU) to minutes (a CPU)
    # at the start. The kinds that offer blocks (Drafter.COMPILED_BLOCKS); losses equal eager within float32 rounding
    compile_drafter: bool = False
    # threads torch computes with on a CPU run; null = draftsmith chooses (draftsmith/threads.py): OMP_NUM_THREADS
    # where it is the user's, else the available cores / the processes on this machine. `accelerate launch`
    # sets OMP_NUM_THREADS=1 for its processes, which cannot be told from a user's 1: under a launcher set this.
    cpu_threads: Optional[int] = None
    # Held-out evaluation during training: the last `heldout` conversations of data.train (in file
    # order, before any shuffling) are never trained on; every `eval_every` optimizer steps (and at
    # the last step) the drafter's teacher-forced per-depth top-1 on them gives `heldout/tau_est`,
    # and the best evaluation so far is kept in <output_dir>/best/ (trainer/heldout.py). 0 = off.
    heldout: int = 0  # conversations held out of data.train; 0 = none
    eval_every: int = 0  # optimizer steps between held-out evaluations; 0 = never (needs heldout > 0)
    # stop on measured acceptance, not on loss: training ends once this many held-out evaluations in a row
    # have not beaten the best tau_est (best/ keeps that one); 0 = never (needs eval_every > 0)
    patience: int = 0


@dataclass
class EvalSection:
    """`python -m eval`: speculative decoding with the drafter against plain decoding and n-gram lookup."""

    # train.py runs the speculative-decoding eval (eval/report.json) when training ends; the eval-split accuracy
    # table (eval_accuracy.json) runs either way
    enabled: bool = True
    data: List[str] = field(default_factory=list)  # the prompts: conversations, answered or not; empty = data.eval
    max_prompts: int = 8  # per domain
    max_new_tokens: int = 64  # per prompt
    temperature: float = 0.0  # 0 = greedy (then every method is checked lossless against plain decoding)
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    top_k: int = 0  # top-k sampling when temperature > 0; 0 = off
    num_speculative_tokens: int = 3  # chain length gamma
    tree: int = 0  # nodes in the static draft tree (0 = chain only)
    ngram_baseline: bool = True  # decode with prompt lookup too (the drafter-free baseline vLLM serves)
    ngram_max: int = PROMPT_LOOKUP_MAX  # prompt-lookup baseline: longest n-gram to match (vLLM's, as served: 4)
    # decode with vLLM's suffix decoding too (arctic-inference's trees, the strongest free baseline): unset =
    # where arctic-inference is installed (the report says when it was not), true = required, false = never
    suffix_baseline: Optional[bool] = None
    # count the prompts data.train answers (report.json's prompts_in_train): reads data.train, which a monitor's
    # replay of its traffic sample, every check, leaves out
    prompts_in_train: bool = True
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0  # sampling seed (temperature > 0)
    # Prompts decoded together (one target forward per cycle for the batch); each row is still checked
    # against plain decoding of its prompt alone.
    batch_size: int = 1
    # a sweep, e.g. [1, 2, 4, 8]: every method at each size (report's batch_sweep)
    batch_sizes: List[int] = field(default_factory=list)


@dataclass
class PushSection:
    """Push exported folders to the Hugging Face Hub (token: HF_TOKEN or the local login)."""

    repo_id: Optional[str] = None  # ORG/NAME for the vllm folder; another engine's folder goes to ORG/NAME-<engine>
    revision: str = "main"  # branch, created when missing
    private: bool = True  # a new repository is created private
    commit_message: Optional[str] = None  # default: the drafter and its eval summary


@dataclass
class SweepSection:
    """`draftsmith sweep`: the export served in vLLM (export.vllm_python) at each concurrency, plain and at each γ,
    on the eval prompts (export/sweep.py); export.batch_sweep reads the sweep.jsonl it writes."""

    output: Optional[str] = None  # default <output_dir>/sweep: sweep.jsonl, summary.json, speedup.png, export/
    concurrency: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])  # requests in flight: 1 to 1024
    # the drafter's γ served at every level; null: 1 up to the longest chain it proposes, at most 5
    gammas: Optional[List[int]] = None
    ngram: bool = True  # vLLM's n-gram proposer (prompt lookup of 2-4 tokens) at every γ too, for comparison
    # vLLM's suffix decoding too (its own length per step; answers not cached across requests, as the sweep
    # repeats prompts): unset = where export.vllm_python has arctic-inference, true = required, false = never
    suffix: Optional[bool] = None
    requests_per_slot: int = 2  # a level serves max(min_requests, requests_per_slot x concurrency) requests
    min_requests: int = 8  # the fewest requests a level serves
    # the engine's OpenMP threads when vLLM runs on CPU; default OMP_NUM_THREADS, else every core
    cpu_threads: Optional[int] = None


@dataclass
class ExportSection:
    """`python -m export`: engine-ready repos from a checkpoint (export/)."""

    engines: List[str] = field(default_factory=lambda: ["vllm"])  # vllm | sglang
    # the vllm folder's layout: speculators | native (EAGLE-3 only: vLLM's LlamaForCausalLMEagle3 config;
    # every other kind has one vLLM layout and refuses native)
    vllm_format: str = VLLM_FORMATS[0]
    output: Optional[str] = None  # default <output_dir>/export; one folder per engine inside
    # γ written into configs and serving commands; default eval.num_speculative_tokens
    num_speculative_tokens: Optional[int] = None
    # the target as the engine names it (Hub id or path); default target.name_or_path (a folder: its absolute path)
    verifier: Optional[str] = None
    # eval report.json for the model card; default <checkpoint>/../eval/report.json if present
    report: Optional[str] = None
    # a Python with vLLM installed: load the vllm folder in the engine and compare it with draftsmith's eval (a bare
    # name is looked up on PATH, a path read from the current directory)
    vllm_python: Optional[str] = None
    # largest relative difference between the engine's tau and draftsmith's (same prompts and schedule)
    tolerance: float = 0.02
    # a load sweep of this checkpoint (the sweep.jsonl `draftsmith sweep` writes): write vLLM's γ per batch
    # size (num_speculative_tokens_per_batch_size) from it; the served γ becomes its largest K
    batch_sweep: Optional[str] = None
    overwrite: bool = False  # replace an export made from another checkpoint (moved aside, not deleted)
    push: PushSection = field(default_factory=PushSection)
    sweep: SweepSection = field(default_factory=SweepSection)


@dataclass
class MonitorSection:
    """`python -m monitor check|watch`: acceptance drift of a deployed export, and retraining (monitor/)."""

    metrics: List[str] = field(default_factory=list)  # Prometheus /metrics URLs of the serving replicas (summed)
    engine: str = "vllm"  # vllm | sglang: which metric names to read
    traffic: Optional[str] = None  # directory of JSONL request logs (messages, optional domain, timestamp)
    # an eval report.json to use as the baseline instead (e.g. one at the serving temperature)
    baseline: Optional[str] = None
    state_dir: Optional[str] = None  # default <output_dir>/monitor: state.json, check records, retraining runs, exports
    min_drafts: int = 200  # verify steps (drafts) a window needs before it is judged
    max_drop: float = 0.10  # drift: acceptance significantly more than this fraction below the baseline
    confidence: float = 0.99  # of the one-sided test
    consecutive: int = 2  # hysteresis: drift in this many checks in a row before retraining
    cooldown_s: float = 21600.0  # no retraining within this long of the last one
    interval_s: float = 300.0  # `watch`: seconds between checks
    sample_per_domain: int = 16  # traffic requests per domain the check evaluates
    traffic_window_s: float = 86400.0  # only requests this recent are sampled
    retrain: bool = True  # start the retraining pipeline on drift (false: only report)
    retrain_samples: int = 128  # requests per drifted or new domain the retraining regenerates and trains on
    new_data_weight: int = 4  # the regenerated traffic is listed this many times beside data.train
    gate_min_gain: float = 0.02  # promote only if tau on the new domains rises by at least this fraction ...
    gate_max_loss: float = 0.02  # ... and tau on the old domains falls by at most this fraction
    # a shell command (/bin/sh -c) run after each check that exits 12, with DRAFTSMITH_EXPORT (the folder to serve)
    # and DRAFTSMITH_REVISION set: `watch` has no exit code to act on; with vLLM's counters every check until the
    # redeploy shows exits 12 again and runs it again, so it must be idempotent
    redeploy_command: Optional[str] = None
    redeploy_timeout_s: float = 600.0  # seconds redeploy_command may run: then it is killed, with what it started


@dataclass
class RecipeSchema:
    """A whole recipe: one section per stage, and where its outputs go."""

    drafter: Any = MISSING  # checked against the drafter type's own schema (heads registry)
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    export: ExportSection = field(default_factory=ExportSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    output_dir: str = MISSING  # the run's directory: checkpoints, logs, eval report, export
    # The drafter a read-only command reads: eval evaluates it (a draftsmith checkpoint or an export's engine
    # folder) and export exports it (a draftsmith checkpoint only: an engine folder is an export already); default
    # <output_dir>/final, where train writes, so a run's saved recipe reads the weights the run trained; monitor
    # watches it (the deployed export's vllm/ or sglang/ folder, whose eval report is the baseline). Train refuses
    # it: a training run starts from train.init_from.
    checkpoint: Optional[str] = None


CHOICES = {
    "target.dtype": ("auto", "float32", "bfloat16", "float16"),
    "target.shard": ("none", "fsdp"),
    "data.overlong": ("truncate", "drop", "error"),
    "data.thinking": ("train", "mask"),
    "data.capture.logits": ("auto", "none", "topk", "full"),
    "data.capture.dtype": ("bfloat16", "float16", "float8"),
    "data.capture.engine": ("transformers", "vllm"),
    "data.capture.vllm.dtype": ("auto", "float32", "bfloat16", "float16"),
    "data.regenerate.engine": ("transformers", "vllm"),
    "data.regenerate.vllm.dtype": ("auto", "float32", "bfloat16", "float16"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"),
}
