"""tirl.rl: GRPO-RoC and the trainers (docs/method.md §3-4).

roc.py          Resample-on-Correct: down-sample 2G rollouts to G (resample_on_correct)
grpo.py         the paper's GRPO in its public names (group_advantages, policy_loss)
advantages.py   advantage estimators by name (grpo, dr_grpo)
losses.py       the objective: policy losses by name (grpo, gspo), aggregations, dual clip, KL, entropy
importance.py   truncated importance sampling against the engine's sampling log-probs (tis_cap)
async_rollout.py the step's groups, streamed (score / RoC on completion), generated ahead under a staleness bound
policy.py       the trainable model: micro-batched log-probs, AdamW, LR schedule, checkpoints
trainer.py      `tirl train`: run_training(cfg, resume=False, progress=True) -> run dir; rl_step
sft.py          `tirl sft`: run_sft(cfg, resume=False, progress=True) -> run dir
hard.py         `tirl data filter-hard`: the stage-3 hard-problem set
checkpoint.py   atomic checkpoints (HF model dir + trainer state), latest_model_dir(run_dir)
distributed.py  FSDP2 (torchrun), full state dicts, collectives
sampler.py      resumable prompt sampling
metrics.py      per-step metrics (JSONL, TensorBoard, W&B) and alerts
config.py       TrainConfig, SFTConfig
"""
