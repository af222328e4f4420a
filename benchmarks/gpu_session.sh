#!/usr/bin/env bash
# Every GPU test and benchmark of the project on one 4-GPU machine, in parts that each
# fit ten minutes. Results and logs go to $OUT (default ./gpu-results).
#
#   bash benchmarks/gpu_session.sh tests       # every GPU test (1 and 2 GPUs)
#   bash benchmarks/gpu_session.sh throughput  # bf16 vs fp8 at 1B; 124M with baselines; post-training
#   bash benchmarks/gpu_session.sh scaling     # 1 and 2 GPUs beside single-GPU tests, then 4 GPUs
#   bash benchmarks/gpu_session.sh memory      # largest model per strategy (80 GB cap), 2-GPU tests
#   bash benchmarks/gpu_session.sh speed       # the speed targets in one part: 124M and 1B MFU,
#                                              # fp8 vs bf16, scaling (also FSDP under Python's
#                                              # automatic GC) and profiles of the steps behind them
#   bash benchmarks/gpu_session.sh offload     # every multi-GPU test, and the offload choices'
#                                              # largest model from 7B up (longer attempts)
#   bash benchmarks/gpu_session.sh long_runs   # single-GPU tests, the end of a run, the
#                                              # memory estimate, the guard's cost (2 GPUs)
#   bash benchmarks/gpu_session.sh stall       # the checkpoint stall, sync vs async (2 GPUs)
#   bash benchmarks/gpu_session.sh long_runs2  # the end of a run, single-GPU tests (2 GPUs)
#   bash benchmarks/gpu_session.sh multigpu    # every multi-GPU test (2 GPUs)
#   bash benchmarks/gpu_session.sh families    # Qwen3 and Gemma 3 throughput against
#                                              # transformers' own models, a Gemma 3 local
#                                              # layer against a global one, the family GPU
#                                              # tests, then Gemma 3 under FSDP (2 GPUs)
#   bash benchmarks/gpu_session.sh families2   # the peer part and Gemma 3's throughput and
#                                              # family tests again, in one ten-minute call
#   bash benchmarks/gpu_session.sh moe         # the experts' grouped GEMM against a loop,
#                                              # moe_1b against transformers' Qwen3-MoE,
#                                              # the MoE and family GPU tests
#   bash benchmarks/gpu_session.sh moe2        # transformers' other experts kernels on moe_1b,
#                                              # the grouped GEMM at fewer tokens per expert
#   bash benchmarks/gpu_session.sh moe3        # moe_1b against the plain loop again, MoE tests
#   bash benchmarks/gpu_session.sh ep          # expert parallelism: the 2-GPU test, the
#                                              # grouped GEMM against the loop, moe_1b on
#                                              # 1 and 2 GPUs (fsdp) and 2 (fsdp+ep)
#   bash benchmarks/gpu_session.sh optim       # the optim choices' step time and memory at 1B,
#                                              # AdamW against Muon on the same tokens, the
#                                              # expert-parallel test and moe_1b's EP scaling
#                                              # on 1 and 2 GPUs (4 GPUs)
#   bash benchmarks/gpu_session.sh hsdp        # HSDP 2 x 2 against one GPU's loss curve, then
#                                              # llama_1b fsdp and hsdp (2 x 2) on 4 GPUs
#   bash benchmarks/gpu_session.sh ep4         # moe_1b fsdp on 1 and 4 GPUs, fsdp+ep on 4
#   bash benchmarks/gpu_session.sh posttrain4  # full SFT, live DPO and LoRA against TRL+Liger
#                                              # after gradients are freed at each step (2 GPUs)
#   bash benchmarks/gpu_session.sh lora_base   # LoRA over bf16 frozen projections against
#                                              # TRL+Liger (fp32 and bf16 folder) and over
#                                              # fp32 ones; estimate; LoRA GPU tests (2 GPUs)
#   bash benchmarks/gpu_session.sh post3       # LoRA estimates; KTO, distillation, LoRA
#                                              # under FSDP (2 GPUs)
#   bash benchmarks/gpu_session.sh frozen_bf16 # DPO and distillation under FSDP over bf16
#                                              # frozen projections; live DPO's peak
#   bash benchmarks/gpu_session.sh ep2         # the expert-parallel test in fp32 and bf16,
#                                              # then the MoE and evaluation GPU tests
#   bash benchmarks/gpu_session.sh post_final  # every post-training case against TRL+Liger,
#                                              # one per GPU; the expert-parallel test (4 GPUs)
#   bash benchmarks/gpu_session.sh post_dpo    # DPO (live, precomputed) against TRL+Liger with
#                                              # room for four compiles at once; moe_1b fsdp
#                                              # on 1 GPU and fsdp+ep on 2 (4 GPUs)
#   bash benchmarks/gpu_session.sh ep_final    # moe_1b fsdp and fsdp+ep on 4 GPUs
#   bash benchmarks/gpu_session.sh moe_lora    # LoRA on the experts under FSDP; the bf16
#                                              # expert-parallel test (4 GPUs)
#   bash benchmarks/gpu_session.sh posttrain   # SFT, LoRA, DPO (live, precomputed) and ORPO
#                                              # against TRL and TRL+Liger at 1B (trl and
#                                              # liger-kernel wheels)
#   bash benchmarks/gpu_session.sh posttrain2  # the cases again one per GPU, DPO at 256 rows
#   bash benchmarks/gpu_session.sh grpo        # rollouts against transformers' generate, GRPO
#                                              # steps against TRL (trl wheel), GRPO and DPO
#                                              # under FSDP on 2 GPUs, the stage curve tests
#   bash benchmarks/gpu_session.sh posttrain3  # each case against TRL+Liger after the fused
#                                              # head's memory changes, and its GPU test
#   bash benchmarks/gpu_session.sh posttrain_memory   # what is alive at each side's peak
#   bash benchmarks/gpu_session.sh posttrain_memory2  # the same, full SFT and live DPO
#   bash benchmarks/gpu_session.sh posttrain_tests  # the fused head, DPO, recipe and stage
#                                              # curve tests, then the multi-GPU tests
#   bash benchmarks/gpu_session.sh peer        # SFT of a qwen3_1_7b folder against TRL, and
#                                              # the fp8 tests (needs the trl and torchao
#                                              # wheels: fetch-wheels.sh trl==1.16.0 ...)
#   bash benchmarks/gpu_session.sh eval        # multiple-choice evaluation at 1B against
#                                              # lm-eval's HF backend (lm-eval wheels), and
#                                              # the evaluation GPU tests
#
# Jobs that run at once each get their own GPUs (CUDA_VISIBLE_DEVICES); no two timed
# measurements share a card. RECORD=1 records the reference loss curves of
# tests/gpu/test_stage_curves.py on this card instead of checking them.
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T=${JOB_TIMEOUT_S:-540}
REC=""
[ "${RECORD:-0}" = 1 ] && REC="RECIPES_RECORD_LOSSES=1"

job() {  # job NAME GPUS COMMAND: run COMMAND in the background, log to $OUT/NAME.log
  local name=$1 gpus=$2
  shift 2
  (CUDA_VISIBLE_DEVICES=$gpus timeout "$T" bash -c "$*" >"$OUT/$name.log" 2>&1
   echo "$name exit $?" >>"$OUT/status.txt") &
}
ONE_GPU_TESTS="-m 'gpu and not multigpu' tests -p no:cacheprovider"
moe_scaling() {  # moe_scaling FILE FSDP_GPUS EP_GPUS FSDP_BUDGET EP_BUDGET: the command that
  # scales moe_1b under fsdp on each of FSDP_GPUS, then fsdp+ep on EP_GPUS, into $OUT/FILE
  local scale="$PY benchmarks/scaling.py --recipe pretrain/moe_1b --no-single-baseline \
    --warmup-steps 6 --steps 12 --timeout-s 110 --out $OUT/$1"
  echo "$scale --gpus $2 --strategies fsdp --budget-s $4;
    $scale --gpus $3 --strategies fsdp+ep --budget-s $5 --resume $OUT/$1"
}

case "${1:-tests}" in
tests)
  job multigpu_tests 0,1 "$PY -m pytest -q tests/gpu/test_multigpu.py -p no:cacheprovider"
  job gpu_tests 2 "env $REC $PY -m pytest -q $ONE_GPU_TESTS;
    cp tests/gpu/reference_losses.json $OUT/"
  wait ;;
throughput)
  job fp8 0 "$PY benchmarks/pretrain_throughput.py --models llama_1b \
    --trainers recipes_lib,plain_pytorch --precisions bf16-mixed,fp8 --out $OUT/fp8_llama_1b.json"
  job gpt_124m 1 "$PY benchmarks/pretrain_throughput.py --models gpt_124m \
    --out $OUT/throughput_gpt_124m.json"
  job posttrain 2 "$PY benchmarks/posttrain.py --out $OUT/posttrain.json"
  wait ;;
scaling)
  job scaling12 0,1 "$PY benchmarks/scaling.py --gpus 1,2 --strategies fsdp,ddp \
    --timeout-s 110 --budget-s 330 --out $OUT/scaling.json"
  job curves_fp8 2 "env $REC $PY -m pytest -q tests/gpu/test_stage_curves.py \
    tests/gpu/test_fp8_gpu.py -p no:cacheprovider; cp tests/gpu/reference_losses.json $OUT/"
  job other_gpu_tests 3 "$PY -m pytest -q $ONE_GPU_TESTS \
    --ignore tests/gpu/test_stage_curves.py --ignore tests/gpu/test_fp8_gpu.py"
  wait
  job scaling4 0,1,2,3 "$PY benchmarks/scaling.py --gpus 4 --strategies fsdp,ddp \
    --no-single-baseline --timeout-s 110 --budget-s 220 --resume $OUT/scaling.json \
    --out $OUT/scaling.json"
  wait ;;
memory)
  job memory 0,1 "$PY benchmarks/memory.py --gpus 0,1 --budget-s 420 --out $OUT/memory.json"
  job multigpu_tests 2,3 "$PY -m pytest -q tests/gpu/test_multigpu.py -p no:cacheprovider;
    CUDA_VISIBLE_DEVICES=2 $PY -m pytest -q tests/gpu/test_stage_curves.py -p no:cacheprovider"
  wait ;;
speed)  # two phases that fit one ten-minute call
  PROFILE="$PY benchmarks/profile_step.py recipe=pretrain/llama_1b --steps 4"
  T=${JOB_TIMEOUT_S:-285}
  job fp8 0 "$PY benchmarks/pretrain_throughput.py --models llama_1b --trainers recipes_lib \
    --precisions bf16-mixed,fp8 --out $OUT/fp8_llama_1b.json;
    $PROFILE precision=fp8 --out $OUT/profile_1b_fp8.json"
  job gpt_124m 1 "$PY benchmarks/pretrain_throughput.py --models gpt_124m \
    --out $OUT/throughput_gpt_124m.json; $PROFILE --out $OUT/profile_1b_bf16.json"
  job scaling12 2,3 "$PY benchmarks/scaling.py --gpus 1,2 --strategies fsdp,ddp \
    --timeout-s 90 --budget-s 260 --out $OUT/scaling.json"
  wait
  job scaling4 0,1,2,3 "$PY benchmarks/scaling.py --gpus 4 --strategies fsdp,ddp,fsdp+autogc \
    --no-single-baseline --timeout-s 90 --budget-s 180 --resume $OUT/scaling.json \
    --out $OUT/scaling.json;
    $PY -m torch.distributed.run --standalone --nproc_per_node=4 \
      benchmarks/profile_step.py recipe=pretrain/llama_1b strategy=fsdp --steps 4 \
      --out $OUT/profile_1b_fsdp4.json"
  wait ;;
long_runs)
  job end_memory 0 "$PY benchmarks/end_of_run.py --out $OUT/end_of_run.json;
    $PY benchmarks/memory_estimate.py --out $OUT/memory_estimate.json"
  job gpu_tests 1 "env $REC $PY -m pytest -q $ONE_GPU_TESTS;
    cp tests/gpu/reference_losses.json $OUT/;
    $PY benchmarks/pretrain_throughput.py --models llama_1b --trainers recipes_lib,plain_pytorch \
      --guard-off --steps 20 --warmup-steps 8 --out $OUT/guard_cost.json"
  wait ;;
stall)
  job stall 0,1 "$PY benchmarks/checkpoint_stall.py --gpus 2 --checkpoint-dir /tmp/ckpt-stall \
    --budget-s 540 --out $OUT/checkpoint_stall.json"
  wait ;;
long_runs2)
  job end 0 "$PY benchmarks/end_of_run.py --out $OUT/end_of_run.json"
  job gpu_tests 1 "env $REC $PY -m pytest -q $ONE_GPU_TESTS;
    cp tests/gpu/reference_losses.json $OUT/"
  wait ;;
families)
  FAST="--warmup-steps 6 --steps 15 --trainers recipes_lib,plain_pytorch,hf_transformers"
  job family_throughput 0 "$PY benchmarks/pretrain_throughput.py --models qwen3_1_7b $FAST \
      --out $OUT/throughput_qwen3_1_7b.json;
    $PY benchmarks/pretrain_throughput.py --models gemma3_1b --attention flex $FAST \
      --out $OUT/throughput_gemma3_1b.json"
  job family_tests 1 "$PY benchmarks/local_attention.py --out $OUT/local_attention.json;
    $PY -m pytest -q -rs -m 'gpu and not multigpu' tests/gpu/test_family_gpu.py -p no:cacheprovider"
  wait
  job family_fsdp 0,1 "$PY -m pytest -q -rs -m multigpu tests/gpu/test_family_gpu.py -p no:cacheprovider"
  wait ;;
families2)
  FAST="--warmup-steps 6 --steps 15 --trainers recipes_lib,plain_pytorch,hf_transformers"
  job sft_peer 0 "$PY benchmarks/posttrain_peer.py --model qwen3_1_7b --cases sft_full \
      --sides recipes_lib,trl --out $OUT/posttrain_peer_qwen3_1_7b.json;
    $PY -m pytest -q -rs -m 'gpu and not multigpu' tests/gpu/test_family_gpu.py -p no:cacheprovider"
  job fp8_gemma 1 "$PY -m pytest -q -rs tests/gpu/test_fp8_gpu.py -p no:cacheprovider;
    $PY benchmarks/pretrain_throughput.py --models gemma3_1b --attention flex $FAST \
      --out $OUT/throughput_gemma3_1b.json"
  wait ;;
moe)
  FAST="--warmup-steps 6 --steps 15 --trainers recipes_lib,plain_pytorch,hf_transformers"
  job moe_throughput 0 "$PY benchmarks/pretrain_throughput.py --models moe_1b $FAST \
      --batch-size 8 --out $OUT/throughput_moe_1b.json"
  job moe_tests 1 "$PY benchmarks/moe_experts.py --out $OUT/moe_experts.json;
    $PY -m pytest -q -rs tests/gpu/test_moe_gpu.py -p no:cacheprovider;
    $PY -m pytest -q -rs -m 'gpu and not multigpu' tests/gpu/test_family_gpu.py -p no:cacheprovider"
  wait ;;
moe2)
  HF="--warmup-steps 6 --steps 15 --trainers hf_transformers --batch-size 8"
  job moe_hf 0 "$PY benchmarks/pretrain_throughput.py --models moe_1b $HF --hf-experts eager \
      --out $OUT/throughput_moe_1b_hf_eager.json;
    $PY benchmarks/pretrain_throughput.py --models moe_1b $HF --hf-experts batched_mm \
      --out $OUT/throughput_moe_1b_hf_batched_mm.json"
  job moe_experts 1 "$PY benchmarks/moe_experts.py --tokens 4096 --cases 8x2,64x8,128x8 \
      --out $OUT/moe_experts_4k.json"
  wait ;;
moe3)
  job moe_throughput 0 "$PY benchmarks/pretrain_throughput.py --models moe_1b --warmup-steps 6 \
      --steps 15 --trainers recipes_lib,plain_pytorch --batch-size 8 \
      --out $OUT/throughput_moe_1b_gather.json"
  job moe_tests 1 "$PY -m pytest -q -rs tests/gpu/test_moe_gpu.py -p no:cacheprovider;
    $PY -m pytest -q -rs -m 'gpu and not multigpu' tests/gpu/test_family_gpu.py -k qwen3_moe \
      -p no:cacheprovider"
  wait ;;
ep)
  job ep_test 0,1 "$PY -m pytest -q -rs -m multigpu tests/gpu/test_family_gpu.py \
      -k expert_parallel -p no:cacheprovider"
  wait
  job moe_experts 0 "$PY benchmarks/moe_experts.py --out $OUT/moe_experts.json;
    $PY benchmarks/moe_experts.py --tokens 4096 --cases 8x2,64x8,128x8 \
      --out $OUT/moe_experts_4k.json"
  wait
  job ep_scaling 0,1 "$(moe_scaling scaling_moe_1b.json 1,2 2 230 120)"
  wait ;;
optim)
  job optim_step 2 "$PY benchmarks/optimizers.py --part step --out $OUT/optimizers_step.json"
  job optim_loss 3 "$PY benchmarks/optimizers.py --part loss --out $OUT/optimizers_loss.json"
  job ep 0,1 "timeout -s INT 240 $PY -m pytest -q -rs -m multigpu tests/gpu/test_family_gpu.py \
      -k expert_parallel -p no:cacheprovider;
    $(moe_scaling scaling_moe_1b.json 1,2 2 200 110)"
  wait ;;
hsdp)
  job hsdp_test 0,1,2,3 "timeout -s INT 200 $PY -m pytest -q -rs tests/gpu/test_multigpu.py -k hsdp \
      -p no:cacheprovider;
    $PY benchmarks/scaling.py --gpus 4 --strategies fsdp,hsdp --warmup-steps 6 --steps 12 \
      --timeout-s 100 --budget-s 330 --out $OUT/scaling_hsdp.json"
  wait ;;
ep4)
  job ep4 0,1,2,3 "$(moe_scaling scaling_moe_1b_4.json 1,4 4 240 120)"
  wait ;;
peer)
  job sft_peer 0 "$PY benchmarks/posttrain_peer.py --model qwen3_1_7b --cases sft_full \
      --sides recipes_lib,trl --out $OUT/posttrain_peer_qwen3_1_7b.json"
  job fp8_tests 1 "$PY -m pytest -q -rs tests/gpu/test_fp8_gpu.py -p no:cacheprovider"
  wait ;;
posttrain)
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 170 --warmup-steps 3 --steps 10"
  job peer_sft 0 "$PEER --cases sft_full,orpo --out $OUT/posttrain_peer_sft_orpo.json"
  job peer_lora 1 "$PEER --cases sft_lora --out $OUT/posttrain_peer_lora.json"
  job peer_dpo 2 "$PEER --cases dpo_live --out $OUT/posttrain_peer_dpo_live.json"
  job peer_dpo_pre 3 "$PEER --cases dpo_precomputed --out $OUT/posttrain_peer_dpo_pre.json"
  wait ;;
posttrain2)  # the cases again, one per GPU; DPO's fused head at 256 rows a chunk
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 170 --warmup-steps 3 --steps 10"
  job peer_sft 0 "$PEER --cases sft_full --out $OUT/posttrain_peer_sft.json"
  job peer_orpo 1 "$PEER --cases orpo --out $OUT/posttrain_peer_orpo.json"
  job peer_lora 2 "$PEER --cases sft_lora --out $OUT/posttrain_peer_lora.json"
  job peer_dpo_256 3 "$PEER --cases dpo_live,dpo_precomputed --sides recipes_lib \
      --override kernels.loss_chunk_size=256 --out $OUT/posttrain_peer_dpo_chunk256.json"
  wait ;;
posttrain_memory)  # what is alive at each side's peak (allocation history on)
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 170 --warmup-steps 2 --steps 3 \
    --memory-breakdown"
  job mem_sft 0 "$PEER --cases sft_full --out $OUT/posttrain_peer_memory_sft.json"
  job mem_lora 1 "$PEER --cases sft_lora --out $OUT/posttrain_peer_memory_lora.json"
  job mem_dpo 2 "$PEER --cases dpo_live --out $OUT/posttrain_peer_memory_dpo.json"
  job head_tests 3 "$PY -m pytest -q -rs tests/unit/training/test_causal_lm_gpu.py \
      tests/gpu/test_dpo_gpu.py tests/gpu/test_stage_curves.py -p no:cacheprovider"
  wait ;;
posttrain_memory2)  # the peaks' breakdown for full SFT and live DPO, and the head test
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 170 --warmup-steps 2 --steps 3 \
    --memory-breakdown --sides recipes_lib,trl_liger"
  job mem_sft 0 "$PEER --cases sft_full --out $OUT/posttrain_peer_memory_sft.json"
  job mem_dpo 1 "$PEER --cases dpo_live --out $OUT/posttrain_peer_memory_dpo.json"
  job head_test 2 "$PY -m pytest -q -rs tests/unit/training/test_causal_lm_gpu.py -k fused \
      -p no:cacheprovider"
  wait ;;
posttrain3)  # after the fused head's memory changes: each case against TRL+Liger
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 150 --warmup-steps 3 --steps 10 \
    --sides recipes_lib,trl_liger"
  job peer_sft 0 "$PEER --cases sft_full --out $OUT/posttrain_peer_sft.json"
  job peer_lora 1 "$PEER --cases sft_lora --out $OUT/posttrain_peer_lora.json"
  job peer_dpo 2 "$PEER --cases dpo_live --out $OUT/posttrain_peer_dpo_live.json"
  job peer_dpo_pre 3 "$PEER --cases dpo_precomputed --out $OUT/posttrain_peer_dpo_pre.json;
    $PY -m pytest -q -rs tests/unit/training/test_causal_lm_gpu.py -k 'fused or chunked' \
      -p no:cacheprovider"
  wait ;;
posttrain4)  # gradients freed at each optimizer step: full SFT, live DPO and LoRA against
  # TRL+Liger, on two GPUs
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 150 --warmup-steps 3 --steps 10 \
    --sides recipes_lib,trl_liger"
  job peer_sft_dpo 0 "$PEER --cases sft_full,dpo_live --out $OUT/posttrain_peer_sft_dpo.json"
  job peer_lora 1 "$PEER --cases sft_lora --out $OUT/posttrain_peer_lora.json"
  wait ;;
posttrain_tests)
  job head_tests 0 "$PY -m pytest -q -rs tests/unit/training/test_causal_lm_gpu.py \
      tests/gpu/test_dpo_gpu.py tests/gpu/test_gpu_recipes.py -p no:cacheprovider"
  job curves 1 "env $REC $PY -m pytest -q -rs tests/gpu/test_stage_curves.py -p no:cacheprovider;
    cp tests/gpu/reference_losses.json $OUT/"
  job multigpu_tests 2,3 "timeout -s INT 400 $PY -m pytest -q -rs tests/gpu/test_multigpu.py \
      -p no:cacheprovider"
  wait ;;
grpo)  # rollouts against transformers' generate, GRPO steps against TRL, GRPO under FSDP
  GRPO="$PY benchmarks/grpo_peer.py --side-timeout 250"
  job rollout 0 "$GRPO --cases rollout --out $OUT/grpo_peer_rollout.json"
  job grpo_step 1 "$GRPO --cases grpo_step --out $OUT/grpo_peer_step.json"
  job grpo_fsdp 2,3 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py -k 'post_training and \
      (grpo or dpo)' -p no:cacheprovider; $PY -m pytest -q -rs tests/gpu/test_stage_curves.py \
      tests/gpu/test_gpu_recipes.py tests/gpu/test_sampling_gpu.py -p no:cacheprovider"
  wait ;;
lora_base)  # LoRA with its frozen projections in bf16 (adapter.base_dtype=auto) against
  # TRL+Liger (fp32 and bf16 folder), and in fp32 (before); the estimate, LoRA's GPU tests
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 150 --warmup-steps 3 --steps 10 \
    --cases sft_lora"
  job peer_lora 0 "$PEER --sides recipes_lib,trl_liger,trl_liger_bf16 \
    --out $OUT/posttrain_peer_lora_base.json"
  job lora_fp32 1 "$PEER --sides recipes_lib --override adapter.base_dtype=float32 \
    --out $OUT/posttrain_peer_lora_fp32_base.json;
    $PY benchmarks/memory_estimate.py --presets llama_1b_lora,llama_3b_lora_ac \
      --out $OUT/memory_estimate_lora.json;
    $PY -m pytest -q -rs tests/gpu/test_stage_curves.py -k 'lora or sft' -p no:cacheprovider"
  wait
  job lora_fsdp 0,1 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py -k 'lora' \
      -p no:cacheprovider"
  wait ;;
post3)  # the LoRA memory estimates after the narrowing fix; KTO, distillation and LoRA SFT
  # under FSDP on two GPUs
  job estimate 0 "$PY benchmarks/memory_estimate.py --presets llama_1b_lora,llama_3b_lora_ac \
    --out $OUT/memory_estimate_lora.json"
  job curves 1 "$PY -m pytest -q -rs tests/gpu/test_stage_curves.py -k 'lora or sft' \
    -p no:cacheprovider"
  wait
  job fsdp_post 0,1 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py \
    -k 'kto or distill or lora_sft' -p no:cacheprovider"
  wait ;;
frozen_bf16)  # DPO's reference and the teacher over bf16 projections: DPO and distillation
  # under FSDP (2 GPUs), then live DPO's peak against TRL+Liger's recorded one
  job fsdp_frozen 0,1 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py \
    -k 'post_training and (dpo or distill)' -p no:cacheprovider"
  wait
  job dpo_live 0 "$PY benchmarks/posttrain_peer.py --side-timeout 150 --warmup-steps 3 \
    --steps 10 --cases dpo_live --sides recipes_lib --out $OUT/posttrain_peer_dpo_frozen.json"
  wait ;;
ep2)  # the expert-parallel test in fp32 and bf16 (2 GPUs), then the MoE and evaluation tests
  job ep_test 0,1 "$PY -m pytest -q -rs -s -m multigpu tests/gpu/test_family_gpu.py \
      -k expert_parallel -p no:cacheprovider"
  wait
  job moe_eval_tests 0 "$PY -m pytest -q -rs -m 'gpu and not multigpu' tests/gpu \
      -k 'eval or moe or expert' -p no:cacheprovider"
  wait ;;
eval)  # multiple-choice evaluation against lm-eval's HF backend, the evaluation GPU tests
  job eval_peer 0 "$PY benchmarks/eval_peer.py --side-timeout 120 --out $OUT/eval_peer.json"
  job eval_tests 1 "$PY -m pytest -q -rs tests/gpu -k eval -p no:cacheprovider"
  wait ;;
post_final)  # every case of posttrain_peer.py against TRL+Liger, then the expert-parallel
  # test in fp32 (against one GPU too) and bf16
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 150 --warmup-steps 3 --steps 10 \
    --sides recipes_lib,trl_liger"
  job peer_sft 0 "$PEER --cases sft_full --out $OUT/posttrain_peer_sft.json"
  job peer_lora 1 "$PEER --cases sft_lora --out $OUT/posttrain_peer_lora.json"
  job peer_dpo 2 "$PEER --cases dpo_live --out $OUT/posttrain_peer_dpo_live.json"
  job peer_dpo_pre 3 "$PEER --cases dpo_precomputed --out $OUT/posttrain_peer_dpo_pre.json"
  wait
  job peer_orpo 0 "$PEER --cases orpo --out $OUT/posttrain_peer_orpo.json"
  job ep_test 2,3 "timeout -s INT 240 $PY -m pytest -q -rs -s -m multigpu \
      tests/gpu/test_family_gpu.py -k expert_parallel -p no:cacheprovider"
  wait ;;
post_dpo)  # the DPO cases again, each side given 280 s (at 150 s both ran past it while
  # four sides compiled at once); moe_1b's expert-parallel scaling on the two other GPUs
  PEER="$PY benchmarks/posttrain_peer.py --side-timeout 280 --warmup-steps 3 --steps 10 \
    --sides recipes_lib,trl_liger"
  job peer_dpo 0 "$PEER --cases dpo_live --out $OUT/posttrain_peer_dpo_live.json"
  job peer_dpo_pre 1 "$PEER --cases dpo_precomputed --out $OUT/posttrain_peer_dpo_pre.json"
  job ep_scaling 2,3 "$(moe_scaling scaling_moe_1b_ep2.json 1 2 200 220)"
  wait ;;
ep_final)
  job ep_scaling 0,1,2,3 "$PY benchmarks/scaling.py --recipe pretrain/moe_1b \
    --no-single-baseline --warmup-steps 6 --steps 12 --timeout-s 150 --gpus 4 \
    --strategies fsdp,fsdp+ep --budget-s 400 --out $OUT/scaling_moe_1b_ep4.json"
  wait ;;
moe_lora)
  job moe_lora 0,1 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py -k experts \
      -p no:cacheprovider"
  job ep_bf16 2,3 "$PY -m pytest -q -rs -s -m multigpu tests/gpu/test_family_gpu.py \
      -k 'expert_parallel and bf16' -p no:cacheprovider"
  wait ;;
multigpu)
  job multigpu_tests 0,1 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py -p no:cacheprovider"
  wait ;;
offload)
  job multigpu_tests 0,1 "$PY -m pytest -q -rs tests/gpu/test_multigpu.py -p no:cacheprovider"
  job memory 2,3 "$PY benchmarks/memory.py --gpus 2,3 \
    --choices fsdp_cpu_offload,deepspeed_zero3_offload,deepspeed_zero3 \
    --models llama_3b,llama2_7b,llama_8b,llama2_13b --steps 1 --timeout-s 300 \
    --budget-s 470 --out $OUT/memory_offload.json"
  wait ;;
esac
cat "$OUT/status.txt"
