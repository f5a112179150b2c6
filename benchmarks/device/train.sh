# bash benchmarks/device/train.sh KIND OUTPUT_DIR MAX_STEPS EVAL_EVERY MICRO_BATCH [override ...]: the standard
# protocol's EAGLE-3.1 recipe (P-EAGLE for KIND=peagle) on every regenerated folder in benchmarks/data (each holds a
# regenerate.settings and a finished part; their READMEs say what they hold). sharegpt_smollm2_9600_16800 goes last:
# train.heldout takes the last conversations of data.train, so the held-out set stays the one every curve so far was
# measured on (and the later-turn and sampled folders were regenerated with its prompts excluded). exec: timeout's
# SIGTERM reaches python.
kind=$1 out=$2 steps=$3 every=$4 micro=$5; shift 5
cd "$(dirname "$0")/../.." || exit 2
heldout=benchmarks/data/sharegpt_smollm2_9600_16800
folders=()
for settings in benchmarks/data/*/regenerate.settings; do
  folder=${settings%/*}
  [ "$folder" != "$heldout" ] && compgen -G "$folder/part-*.jsonl.gz" > /dev/null && folders+=("$folder")
done
train=$(IFS=,; echo "${folders[*]},$heldout")
extra=()
[ "$kind" = peagle ] && extra=(drafter.parallel_drafting=true drafter.mask_token_id=16)
echo "data.train: $train"
exec python3 train.py recipe=eagle3_sharegpt_smollm2 "data.train=[$train]" \
  data.max_conversations=null "data.eval=[]" eval.enabled=false train.max_steps=$steps train.micro_batch_size=$micro \
  train.lr=1e-3 train.warmup_steps=50 train.heldout=64 train.eval_every=$every train.save_every=100000 \
  train.log_every=10 train.mixed_precision=bf16 output_dir=$out "${extra[@]}" "$@"
