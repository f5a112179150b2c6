# bash benchmarks/device/train.sh KIND OUTPUT_DIR MAX_STEPS EVAL_EVERY MICRO_BATCH [override ...]: the standard protocol's
# EAGLE-3.1 recipe (P-EAGLE for KIND=peagle) on all 15,824 regenerated ShareGPT first turns committed in
# benchmarks/data, 5.0M tokens (run 3 trained on the first two folders, 5,619). exec: timeout's SIGTERM reaches python.
kind=$1 out=$2 steps=$3 every=$4 micro=$5; shift 5
extra=()
[ "$kind" = peagle ] && extra=(drafter.parallel_drafting=true drafter.mask_token_id=16)
exec python3 train.py recipe=eagle3_sharegpt_smollm2 "data.train=[benchmarks/data/sharegpt_smollm2,benchmarks/data/sharegpt_smollm2_more,benchmarks/data/sharegpt_smollm2_6000_9600,benchmarks/data/sharegpt_smollm2_9600_16800]" \
  data.max_conversations=null "data.eval=[]" eval.enabled=false train.max_steps=$steps train.micro_batch_size=$micro \
  train.lr=1e-3 train.warmup_steps=50 train.heldout=64 train.eval_every=$every train.save_every=100000 \
  train.log_every=10 train.mixed_precision=bf16 output_dir=$out "${extra[@]}" "$@"
