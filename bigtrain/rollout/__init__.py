"""Online RL's building blocks (issue 38, sections 2-4): generation on the training engine, rewards, and the math
of GRPO, RLOO and on-policy distillation, each a function of tensors or of a module, tested alone. The objectives
that assemble them (objective.kind=grpo | rloo | distill) come once the objective seam (issue 38, section 1) lets an
objective declare what it needs; this docstring is the plan for that wiring.

    generate.py         sampling completions from the policy's engine (DeepSpeed's HybridEngineRollout where the
                        ZeRO-3 weights stay partitioned, gathered once a round otherwise), a per-rank sampling
                        stream saved with the checkpoint, eval mode and the model's generation_config set aside
    forward.py          the logits that predict a completion's tokens (policy, old policy, reference, teacher)
    rewards.py          reward functions by file or module name, called with TRL's keywords; one line when bad
    builtin_rewards.py  accuracy (against the record's answer), format[=REGEX], length (DAPO's overlong penalty)
    reward_model.py     a reward-model directory scored at each row's last real token
    advantages.py       GRPO's group advantages (scale_rewards), RLOO's leave-one-out, its k1 KL penalty
    losses.py           the clipped surrogate (token / sequence ratio), k3 KL, grpo | dr_grpo | dapo | bnpo as
                        shares of a step, RLOO's sequence loss, clip metrics, distillation (DeepSpeed's JSD)
    metrics.py          TRL's metric names and values
    (bigtrain.data.prompts / prompt_rows: prompt-only records, every column kept for the rewards)

What an online objective will declare (the seam's declaration): data layout "prompts" (data.format=prompt, and
ExampleOptions.prompt_tokens = data.seq_len - objective.max_completion_length: the data refuses prompt records
without it); rows per sample: num_generations completions per prompt, each rank generating whole groups (the global
batch a multiple of num_generations x data-parallel ranks: one line otherwise); references allowed: none (beta 0,
GRPO's default: no reference is built), copy or adapters_off (beta > 0; not precomputed: the completions do not
exist before the step); generates: yes; extra frozen models: each reward-model directory, or the distillation
teacher (same tokenizer or one line), partitioned like the policy under ZeRO-3; FLOPs per token: generation
(2N a generated token, plus the prompts' prefill), the old policy's forward when num_iterations > 1 (RLOO: always),
the reference's forward when beta > 0, the policy's 6N, a reward model's or teacher's 2N; modes: no pipeline
stages, tensor or sequence parallelism (a TP group would have to sample alike: later), no packing, no chunked loss
(the loss needs per-token log-probs) and no compile at first.

A step, with the time of each part in the log line and summary.json (generation / rewards / reference / policy):
1. generation: this rank's prompts (global batch / (num_generations x ranks)) from the prompt bundle
   (`take` + `records(prompt_index)`), `generate(engine, tokenizer, ..., Sampling(...), rng, gather=...)` with
   gather on when the whole model fits one device (the estimate knows) and `logps` when num_iterations > 1;
2. rewards: completions decoded (skip_special_tokens; conversational prompts get [{"role": "assistant", ...}]),
   `score()` on this rank's completions with each completion's record, the [N_local, F] scores all-gathered
   (a few floats), `combine_rewards` + `group_advantages` / `rloo_advantages` on the global batch, this rank's
   slice kept; reward and completion metrics from the global tensors; a sample of prompts, completions and
   rewards written to the run folder (jsonl) every log step;
3. reference: k3 KL terms need the reference's log-probs (a frozen copy's engine, or the policy with its
   adapters off), RLOO's penalty the old policy's and the reference's, each one forward (`completion_logits`);
4. policy: num_iterations optimizer steps over the generation batch, each over the accumulated micro-batches:
   `completion_logits(engine, ...)` -> `token_logps` -> `grpo_terms` (or `rloo_terms`) -> `aggregate` (dapo:
   `global_count` of the step's tokens first) -> share x (accumulation steps x ranks) -> engine.backward; the
   loss's metrics as `Sums`, reduced once per micro-batch (`reduce_sums`) and averaged as TRL logs them.
The stepper gives the objective what this needs and no more: generate(prompts) -> Rollout, the logits of a
model (policy, reference, teacher) on a rollout, backward on a share; a checkpoint saves each rank's
`SampleRNG.state_dict()` beside the data sampler's state, so a resumed run samples what the uninterrupted one would
have (at the same world size; at another, the streams restart from the saved seed per rank).
"""
