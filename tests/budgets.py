"""What each test file may cost, in CPU seconds (its tests, their fixtures, and the processes they start: see
tests/budget.py), on the 2-core machines the suite runs on. The suite fails when a file passes its line, so that the
next feature pays for its own time: make its tests cheaper (share a launch, size a fixture to what it proves) or
raise its line here in the same change, saying why.

A file not listed gets its tier's default. Each listed budget is about twice a measured cost (the comment): CPU
seconds move far less than wall time with the machine's load, but a busy machine still slows each core (shared
caches), and a file measured alone pays start-up costs once more than it does in a session. On 2 cores the suite's
wall time is about its CPU seconds over 2 plus the idle ends of its two workers.
"""
from __future__ import annotations

DEFAULT = {"tests/unit/": 12.0, "tests/dist/": 60.0}
# The unit tier together (`pytest tests/unit` runs it in one process): 152 CPU seconds of tests with every extra
# installed, 208 s of wall time at load 3 (2026-11-28, after the generate, recipes, hub and precheck tests landed);
# the aim is under 90 s of wall time with [test] alone: lower this line as the tier gets there.
TIERS = {"tests/unit/": 650.0}  # 324 CPU s in a whole session (2026-11-28, -n 2)

# Measured: CPU seconds of the file alone (pytest on that file, no -n), 2026-11-28, this 2-core AMD EPYC VM while
# other jobs kept its load at 5-30; the budget about twice that.
BUDGETS = {
    "tests/unit/test_models.py": 20,  # 9 in a whole session (2026-11-28, -n 2)
    # 15.0 alone at load ~8, 2026-12-02 (17.0 before a model's lean norms shared one probe); 11 in a session (-n 2)
    "tests/unit/test_estimate_split.py": 30,
    "tests/unit/test_defaults.py": 120,  # 59 in a whole session (2026-11-28, -n 2)
    "tests/unit/test_eval.py": 20,  # 9.5 at load 3 (lm-eval's own HFLM run beside bigtrain's, local task index)
    # 28.2 at load 11 on 2026-12-02, 26.2 without the plain-text fine-tune's run and export (measured alike, A B
    # A B; a run of either cost 100+ while another file's launch shared the cores); 12.4 when first measured
    "tests/unit/test_generate.py": 56,
    "tests/unit/test_lora.py": 21,  # 10.3 at load 7, 3.1 at load 3
    # 39.2 alone at load ~8, 2026-12-02 (46.4 before a model's lean norms shared one probe); 35 in a session
    "tests/unit/test_recipes.py": 80,
    "tests/unit/test_estimate.py": 19,  # 8.2-9.4 (meta-device forward passes of GPT-2 XL, every layer, 4 times)
    "tests/unit/test_estimate_online.py": 45,  # 24.7 at load 5.5 (a 32-token round, 8-layer Llama, LiveBytes)
    "tests/unit/test_objective_seam.py": 125,  # 61 in a session; alone 8.8
    "tests/unit/test_bench.py": 17,  # 7.8-8.4
    "tests/unit/test_lean_rms_norm.py": 15,  # 7.2 alone (2026-11-28, load 3: 16 norm and tiny-Llama checks)
    "tests/unit/test_token_profile.py": 45,  # 19.7 alone (2026-11-29: the 15 rows share their 6 meta-device shapes; 55 before)
    "tests/unit/test_distill.py": 12,  # 6.0
    "tests/unit/test_rollout_math.py": 20,  # 9-11 at load 14 (trl's import; ~150 comparisons with TRL's losses)
    "tests/unit/test_bench_online.py": 8,  # 0.29 (the GPU plan built, a page section written from saved results)
    # 160 alone (181 before the dry run's Llama 1B efficiency row left its --only, 2026-11-28 at load 1-1.5): 11 launches
    # through the deepspeed launcher, as the bench runs jobs (the short sweep's peak and 4 rows, the dry run's peak and
    # 6 rows); + 18 for `bench --trl --dry-run --only grpo` (2026-12-02: bigtrain's GRPO job and TRL's GRPOTrainer, one
    # process each; 40 when the dry run ran two levers beside them); 123 for the file in a fresh clone's session
    "tests/dist/test_bench_runs.py": 400,
    "tests/dist/test_eval_runs.py": 230,  # 103 and 118 in two runs alone at load 1-3 (2026-11-28)
    # 90 and 140 in two runs alone at load 13 (2026-12-02): two launches, 2 ranks x 7 jobs (3 families at ZeRO-3, LoRA,
    # its logits, DPO, GRPO) and 1 process x 4 (the references, the learning task's steps), the exports and the
    # scoring in the test process
    "tests/dist/test_vlm_training.py": 250,
    # 78 in a fresh clone's whole session on an idle VM, 150 and 184 alone at load 10 (2026-12-02): TRL's GRPOTrainer
    # and RLOOTrainer 3 seeds each in one process, bigtrain's 12 jobs in two launches (one process; 2 ranks at
    # ZeRO-3), 20 steps of 128 completions each
    "tests/dist/test_rl_learning.py": 370,
    "tests/dist/test_online_rl.py": 90,  # 42.8 (GRPO, RLOO and distillation: two launches, the jobs shared)
    # 31.3 alone at load ~5, 2026-12-02 (one launch on 2 ranks: 9 training jobs and bigtrain generate --zero3 with a
    # tool; 6 plain loops in the test process)
    "tests/dist/test_agentic_rl.py": 70,
    # 137 alone at load ~2.7 with 3 seeds, 198 with 6 at load ~5 (2026-12-02): the fine-tune (one process, 800
    # steps), TRL's GRPOTrainer 5 seeds in one process, bigtrain's 5 seeds in one launch of 2 ranks at ZeRO-3, 16
    # steps of 32 multi-turn completions each
    "tests/dist/test_agentic_learning.py": 340,
    "tests/dist/test_levers.py": 150,  # 72 in a session, 2026-11-29 (118 alone before torch.compile left the suite: Muon's C++ kernels)
    # 100.9 alone at load 1.3 (103.8 for the file before its exports and refusals ran in the test process, measured
    # alike just before); 117 in a whole session at load ~8 (2026-12-02)
    "tests/dist/test_run_guard_journeys.py": 210,
    "tests/dist/test_equivalence.py": 150,  # 75 alone, every model in one launch (91 in a session as three launches)
    "tests/dist/test_tensor_sequence.py": 250,  # 124.7: one 4-rank launch of 10 jobs (wall 394 s at load 15-20)
    "tests/dist/test_parallel_modes.py": 180,  # 88 (190 before: 4 launches, 6 export commands)
    "tests/dist/test_multinode.py": 160,  # 76
    "tests/dist/test_runner.py": 90,  # 37 alone at load 0.5, 45 at load 2.5 (52 at load 0.5 before its shared launch)
    "tests/dist/test_journey.py": 100,  # 50 alone at load 1 (63 before its plan went through torchrun)
    "tests/dist/test_failures.py": 120,  # 43 alone at load 0.5, 54 at load 2.5; 111 in a session at 79edf2c
    "tests/dist/test_lora_training.py": 110,  # 53 alone at load 1 (58 with a third launch for the references)
    "tests/dist/test_export.py": 180,  # 89 in a session; alone 37
    "tests/dist/test_reshape_resume.py": 80,  # 36
    "tests/dist/test_hf_models_training.py": 70,  # 32
    # 147.5 alone with inductor's cache empty (a fresh machine) at load 6-9, 2026-12-02, one block (175.5 with two:
    # rank 0's own CPU 28.5 -> 19.3 s, the compiles 21.1 -> 12.3 s); 88 in a session with two blocks
    "tests/dist/test_compile_training.py": 160,
    "tests/dist/test_preference_training.py": 80,  # 36 (as of its rewrite in flight: measure it again when it lands)
    "tests/dist/test_rollout_generation.py": 60,  # 28.5
    "tests/dist/test_reward_model.py": 150,  # 73 in a session; alone 24
    # 41.8 alone at load 8 (52.1 when the one-process references were `bigtrain` processes too): two 2-rank launches
    "tests/dist/test_generate_ranks.py": 85,
    # 10.1 alone at load 9 (44.9 when each refusal was a `bigtrain` process of its own; now in the test process)
    "tests/dist/test_precheck_runs.py": 25,
    "tests/dist/test_hub_training.py": 60,  # 26
    "tests/dist/test_recipes_train.py": 50,  # 22
    "tests/dist/test_estimate_measured.py": 60,  # 27
    "tests/dist/test_ray.py": 45,  # 19-22 at load 1-2 (Ray's own processes are not this process's children: uncounted)
    "tests/dist/test_chat_training.py": 50,  # 24
    "tests/dist/test_parallel_ranks.py": 40,  # 19
    "tests/dist/test_checkpoint_moved_run.py": 125,  # 60 in a session; alone 16
    "tests/dist/test_data_ranks.py": 20,  # 6
}


def budget_of(test_file: str) -> float:
    """The CPU seconds `test_file` (a path from the repository root, as pytest's node ids give it) may cost."""
    if test_file in BUDGETS:
        return BUDGETS[test_file]
    return next((seconds for folder, seconds in DEFAULT.items() if test_file.startswith(folder)), DEFAULT["tests/dist/"])


def over_budget(costs: dict[str, float], scale: float = 1.0) -> list[str]:
    """One line per file (and per tier) whose cost passed its budget (times `scale`), naming both and where to
    change them."""
    lines = [f"{name}: {spent:.0f} CPU seconds, over its budget of {scale * budget_of(name):.0f} (tests/budgets.py): "
             "share a launch or shrink a fixture, or raise its line there saying why"
             for name, spent in sorted(costs.items()) if spent > scale * budget_of(name)]
    for folder, seconds in TIERS.items():
        spent = sum(cost for name, cost in costs.items() if name.startswith(folder))
        if spent > scale * seconds:
            lines.append(f"{folder}: {spent:.0f} CPU seconds in all, over the tier's budget of {scale * seconds:.0f} "
                         "(tests/budgets.py): make its costliest files cheaper")
    return lines
