#!/usr/bin/env bash
# The project's GPU tests and benchmarks as a fixed matrix of named parts, each made to
# end inside ten minutes on one 4-GPU host. Each part writes one current result file per
# case and card to $OUT (default ./gpu-results), named as in benchmarks/results/
# (CASE_<card>.json), so a part's results replace the committed ones: history lives in
# git, not in file names.
#
#   bash benchmarks/gpu_session.sh tests        # every GPU test: 2-GPU tests beside the
#                                               # one-GPU ones (RECORD=1 records the
#                                               # stage curves on this card)
#   bash benchmarks/gpu_session.sh pretraining  # llama_1b bf16 against fp8; gpt_124m,
#                                               # qwen3_1_7b and gemma3_1b against a plain
#                                               # loop and transformers; a gemma3 local
#                                               # attention layer against a global one
#   bash benchmarks/gpu_session.sh posttrain [OBJECTIVES [MATRIX ARGS...]]
#                                               # the post-training matrix against TRL and
#                                               # TRL+Liger (posttrain_matrix.py) for
#                                               # OBJECTIVES (comma-separated, default
#                                               # sft_full), every data shape and both
#                                               # settings, filling posttrain_matrix_<card>
#   bash benchmarks/gpu_session.sh scaling      # FSDP and DDP on 1, 2 and 4 GPUs
#   bash benchmarks/gpu_session.sh memory       # the largest model per strategy (80 GB
#                                               # cap), the offload choices, the estimate
#   bash benchmarks/gpu_session.sh moe          # grouped GEMM against a loop, moe_1b
#                                               # against transformers, the MoE tests,
#                                               # moe_1b's expert-parallel scaling
#   bash benchmarks/gpu_session.sh evaluation   # evaluation against lm-eval's HF backend,
#                                               # rollouts against transformers' generate,
#                                               # the evaluation GPU tests
#   bash benchmarks/gpu_session.sh runs         # the end of a run, the guard's cost and
#                                               # the checkpoint stall (2 GPUs)
#
# One posttrain call fills about 18 side processes (one objective: 3 data shapes x 2
# settings x 3 sides); `posttrain_matrix.py --dry-run --objectives ...` prints a part's
# plan and a rough time. dpo_precomputed and grpo take two calls each (add `--data
# short,long`, then `--data heavy`); the matrix starts no side past its 480 s budget. The matrix file in benchmarks/results/ is copied to $OUT first,
# so each call adds its cells to the card's file.
#
# Jobs that run at once each get their own GPUs (CUDA_VISIBLE_DEVICES); no two timed
# measurements share a card. Peer packages travel as wheels: benchmarks/results/NOTES.md
# ("The GPU matrix") gives the install preamble.
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T=${JOB_TIMEOUT_S:-560}
REC=""
[ "${RECORD:-0}" = 1 ] && REC="RECIPES_RECORD_LOSSES=1"
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
  *H200*) CARD=h200 ;;
  *H100*) CARD=h100 ;;
  *) CARD=gpu ;;
esac

job() {  # job NAME GPUS COMMAND: run COMMAND in the background, log to $OUT/NAME.log
  local name=$1 gpus=$2
  shift 2
  (CUDA_VISIBLE_DEVICES=$gpus timeout "$T" bash -c "$*" >"$OUT/$name.log" 2>&1
   echo "$name exit $?" >>"$OUT/status.txt") &
}
ONE_GPU_TESTS="-m 'gpu and not multigpu' tests -p no:cacheprovider"
FAST="--warmup-steps 6 --steps 15 --trainers recipes_lib,plain_pytorch,hf_transformers"

case "${1:-tests}" in
tests)
  job multigpu_tests 0,1 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py -p no:cacheprovider"
  job gpu_tests 2 "env $REC $PY -m pytest -q -rs $ONE_GPU_TESTS \
      --ignore tests/gpu/test_family_gpu.py --ignore tests/gpu/test_moe_gpu.py;
    cp tests/gpu/reference_losses.json $OUT/"
  job family_tests 3 "$PY -m pytest -q -rs -m 'gpu and not multigpu' tests/gpu/test_family_gpu.py \
      tests/gpu/test_moe_gpu.py -p no:cacheprovider"
  wait ;;
pretraining)
  job llama_1b 0 "$PY benchmarks/pretrain_throughput.py --models llama_1b \
    --trainers recipes_lib,plain_pytorch --precisions bf16-mixed,fp8 \
    --out $OUT/pretrain_throughput_llama_1b_$CARD.json"
  job gpt_124m 1 "$PY benchmarks/pretrain_throughput.py --models gpt_124m \
    --out $OUT/pretrain_throughput_gpt_124m_$CARD.json"
  job qwen3 2 "$PY benchmarks/pretrain_throughput.py --models qwen3_1_7b $FAST \
    --out $OUT/pretrain_throughput_qwen3_1_7b_$CARD.json"
  job gemma3 3 "$PY benchmarks/pretrain_throughput.py --models gemma3_1b --attention flex $FAST \
      --out $OUT/pretrain_throughput_gemma3_1b_$CARD.json;
    $PY benchmarks/local_attention.py --out $OUT/local_attention_$CARD.json"
  wait ;;
posttrain)
  OBJECTIVES=${2:-sft_full}
  shift $(($# < 2 ? $# : 2))
  [ -f "benchmarks/results/posttrain_matrix_$CARD.json" ] && [ ! -f "$OUT/posttrain_matrix_$CARD.json" ] \
    && cp "benchmarks/results/posttrain_matrix_$CARD.json" "$OUT/"
  # one process, the matrix's own queue over the four GPUs; it starts no side that
  # would end past its budget
  job posttrain_matrix 0,1,2,3 "$PY benchmarks/posttrain_matrix.py --objectives $OBJECTIVES \
    --budget-s 480 --side-timeout 300 --out-dir $OUT $*"
  wait ;;
scaling)
  job scaling12 0,1 "$PY benchmarks/scaling.py --gpus 1,2 --strategies fsdp,ddp \
    --timeout-s 110 --budget-s 300 --out $OUT/scaling_$CARD.json"
  job curves 2 "$PY -m pytest -q -rs tests/gpu/test_stage_curves.py -p no:cacheprovider"
  wait
  job scaling4 0,1,2,3 "$PY benchmarks/scaling.py --gpus 4 --strategies fsdp,ddp \
    --no-single-baseline --timeout-s 110 --budget-s 220 --resume $OUT/scaling_$CARD.json \
    --out $OUT/scaling_$CARD.json"
  wait ;;
memory)
  job memory 0,1 "$PY benchmarks/memory.py --gpus 0,1 --budget-s 330 --out $OUT/memory_$CARD.json;
    CUDA_VISIBLE_DEVICES=0 $PY benchmarks/memory_estimate.py --out $OUT/memory_estimate_$CARD.json"
  job offload 2,3 "$PY benchmarks/memory.py --gpus 2,3 \
    --choices fsdp_cpu_offload,deepspeed_zero3_offload,deepspeed_zero3 \
    --models llama_3b,llama2_7b,llama_8b --steps 1 --timeout-s 240 \
    --budget-s 480 --out $OUT/memory_offload_$CARD.json"
  wait ;;
moe)
  job moe_throughput 0 "$PY benchmarks/pretrain_throughput.py --models moe_1b $FAST \
      --batch-size 8 --out $OUT/pretrain_throughput_moe_1b_$CARD.json"
  job moe_experts 1 "$PY benchmarks/moe_experts.py --out $OUT/moe_experts_$CARD.json;
    $PY -m pytest -q -rs tests/gpu/test_moe_gpu.py -p no:cacheprovider"
  job ep_scaling 2,3 "timeout -s INT 200 $PY -m pytest -q -rs -m multigpu \
      tests/gpu/test_family_gpu.py -k expert_parallel -p no:cacheprovider;
    $PY benchmarks/scaling.py --recipe pretrain/moe_1b --no-single-baseline --warmup-steps 6 \
      --steps 12 --timeout-s 110 --gpus 1,2 --strategies fsdp,fsdp+ep --budget-s 300 \
      --out $OUT/scaling_moe_1b_$CARD.json"
  wait ;;
evaluation)
  job eval_peer 0 "$PY benchmarks/eval_peer.py --side-timeout 120 --out $OUT/eval_peer_$CARD.json"
  job rollout 1 "$PY benchmarks/grpo_peer.py --side-timeout 250 --cases rollout \
    --out $OUT/grpo_peer_rollout_$CARD.json"
  job eval_tests 2 "$PY -m pytest -q -rs tests/gpu -k 'eval or sampling' -p no:cacheprovider"
  wait ;;
runs)
  job end_of_run 0 "$PY benchmarks/end_of_run.py --out $OUT/end_of_run_$CARD.json"
  job guard_cost 1 "$PY benchmarks/pretrain_throughput.py --models llama_1b \
    --trainers recipes_lib,plain_pytorch --guard-off --steps 20 --warmup-steps 8 \
    --out $OUT/guard_cost_$CARD.json"
  job stall 2,3 "$PY benchmarks/checkpoint_stall.py --gpus 2 --checkpoint-dir /tmp/ckpt-stall \
    --budget-s 500 --out $OUT/checkpoint_stall_$CARD.json"
  wait ;;
*)
  echo "unknown part '$1': tests, pretraining, posttrain, scaling, memory, moe, evaluation, runs" >&2
  exit 2 ;;
esac
cat "$OUT/status.txt"
