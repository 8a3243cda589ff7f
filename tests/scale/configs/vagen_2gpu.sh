#!/bin/bash
# GRPO on a VAGEN sokoban env, tuned by hand for two A40s.
set -x

export VLLM_ATTENTION_BACKEND=XFORMERS
export PYTHONHASHSEED=0

N_GPUS=${N_GPUS:-2}          # GPUs on this box
TP=2                         # rollout tensor parallel
MODEL=Qwen/Qwen2.5-VL-3B-Instruct
EXPERIMENT="sokoban_${N_GPUS}gpu"
BATCH=2

CUDA_VISIBLE_DEVICES=0,1 python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=data/sokoban/train.parquet \
    data.train_batch_size=$BATCH \
    data.max_prompt_length=1024 \
    data.max_response_length=776 \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.actor.ppo_mini_batch_size=${BATCH} \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=$TP \
    actor_rollout_ref.rollout.gpu_memory_utilization="0.34" \
    actor_rollout_ref.rollout.max_num_seqs=4 \
    actor_rollout_ref.rollout.max_num_batched_tokens=1800 \
    actor_rollout_ref.rollout.n=1 \
    trainer.logger=['console','wandb'] \
    trainer.experiment_name="${EXPERIMENT}" \
    trainer.n_gpus_per_node=$N_GPUS \
    trainer.nnodes=1 \
    trainer.total_epochs=15 "$@" 2>&1 | tee logs/${EXPERIMENT}.log
