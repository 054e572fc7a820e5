"""Online RL's building blocks: generation on the training engine, rewards, and the math
of GRPO, RLOO and on-policy distillation, each a function of tensors or of a module, tested alone. The objectives
assemble them: objective.kind=grpo and rloo (bigtrain/objectives/grpo.py), distill (distill.py), on online.py's
step.

    generate.py         sampling completions from the policy's engine (DeepSpeed's HybridEngineRollout where the
                        ZeRO-3 weights stay partitioned, gathered once a round otherwise), a per-rank sampling
                        stream saved with the checkpoint, eval mode and the model's generation_config set aside
    forward.py          the logits that predict a completion's tokens (policy, old policy, reference, teacher)
    rewards.py          reward functions by file or module name, called with TRL's keywords (async ones together);
                        what they log kept; one line when bad
    event_loop.py       the process's event loop for async reward functions (a daemon thread, as TRL's)
    builtin_rewards.py  accuracy (against the record's answer), format[=REGEX], length (DAPO's overlong penalty)
    reward_model.py     a reward-model directory scored at each row's last real token
    advantages.py       GRPO's group advantages (scale_rewards), RLOO's leave-one-out, its k1 KL penalty
    losses.py           GRPO's per-token loss by loss type (the clipped surrogate, cispo, sapo, vespo; token /
                        sequence ratio), k3 KL, RLOO's sequence loss, a step's token count, the loss types'
                        metrics, distillation (DeepSpeed's JSD); the loss types' aggregation is
                        bigtrain.objectives.loss_types (its names are TRL's, "grpo" among them)
    loss_weights.py     the off-policy sequence mask, the high-entropy token mask, VESPO's gamma weights
    metrics.py          TRL's metric names and values
    tools.py            tools (objective.tools) by name, their JSON schemas (transformers' get_json_schema), a turn's
                        calls run side by side with a timeout, every failure the tool's answer
    environments.py     objective.environment: the instances of each rollout, reset, their methods as tools, their
                        get_reward as a reward; the Toolbox of a run
    tool_format.py      the calls read as the tokenizer's template writes them (its response_template; Hermes, Llama
                        3.1, Mistral), the results' tokens as the difference of two renders, a template's fitness
    agent.py            rollouts over several turns of calls and results, every rank in lockstep at ZeRO-3
    (bigtrain.data.prompts / prompt_rows: prompt-only records, every column kept for the rewards)

How the objectives use them, step by step, is bigtrain/objectives/online.py's docstring; docs/online-rl.md is the
user's page. What an online objective declares: data layout "prompts" (data.format=prompt, prompts of at most
data.seq_len - objective.max_completion_length tokens), num_generations completions per prompt with every rank
generating whole groups, references only when beta > 0 (copy or adapters_off; never precomputed), the reward model
as a frozen model partitioned like the policy; no pipeline stages, tensor or sequence parallelism, packing, chunked
loss or compile. A checkpoint saves each rank's `SampleRNG.state_dict()` (and a round still in use) beside the
rank's RNG state, so a resumed run samples what the uninterrupted one would have (at the same world size; at
another, the streams restart from the seed per rank).
"""
