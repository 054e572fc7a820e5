"""The longest sequence one device trains with every long-sequence lever on, the GPU plan's last cases: a ladder of
lengths per model, each rung a real bigtrain job of `LONG_STEPS` steps on one device, micro-batch 1.

Every lever: activation checkpointing with the checkpointed hidden states in host memory
(`activation_checkpointing.offload_hidden_states`), ALST's tiled MLP, the chunked loss, ZeRO-3 with the optimizer's
states in host memory. Llama-1B trains every weight; Llama-8B trains LoRA adapters (r=16) on its frozen bf16 base,
as one fine-tunes it on one device: its full training needs 16 bytes a weight of model states (128 GB), more than
the GPU lease's host holds beside the offloaded hidden states.

The rungs are lengths whose steps take seconds to a minute on one H200 (attention grows with the square of the
length): they measure the peak device memory per token (the slope between the two longest rungs that trained), and
the table extrapolates the longest length the device holds from it; a rung that runs out of memory says so (a
finding, not a failure). Compare with `bigtrain estimate --model llama --size 1b --seq-len N --gpu-mem 141GB
--tiled-mlp true --offload-hidden-states true --num-gpus 1`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from bigtrain.bench.cases import Case, Strategy, Workload

LONG_STEPS = 3  # a warm-up step, then two measured
LONG_STRATEGY = Strategy(zero=3, offload="optimizer", checkpointing=True)
EVERY_LEVER = (("activation_checkpointing.tiled_mlp", "true"), ("activation_checkpointing.offload_hidden_states", "true"),
               ("train.loss_impl", "chunked"))


@dataclass(frozen=True)
class Ladder:
    name: str
    workload: Workload
    rungs: tuple[int, ...]  # tokens per sample, shortest first
    sets: tuple[tuple[str, str], ...] = ()


LADDERS = (
    Ladder("llama-1b", Workload("llama-1b", "llama", "1b", {}, vocab_size=128256, micro_batch=1, precision="bf16"),
           (32768, 65536, 131072)),
    Ladder("llama-8b LoRA r=16", Workload("llama-8b", "llama", "8b", {}, vocab_size=128256, micro_batch=1,
                                          precision="bf16"), (16384, 32768, 65536), (("lora.r", "16"),)),
)
# A dry run (`bigtrain bench --gpu --dry-run`): the same cases on a tiny Llama on this host's CPU.
DRY_RUNGS = (64, 128)
DRY_SHAPE = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_kv_head": 1, "intermediate_size": 128}


def longest_cases(dry: bool = False) -> list[Case]:
    """One case per rung of each ladder (tiny models and rungs when `dry`)."""
    cases = []
    for ladder in LADDERS:
        workload = replace(ladder.workload, name=ladder.name + (" (dry)" if dry else ""))
        if dry:
            workload = replace(workload, size="custom", overrides=DRY_SHAPE, vocab_size=500)
        for tokens in DRY_RUNGS if dry else ladder.rungs:
            cases.append(Case(replace(workload, seq_len=tokens), LONG_STRATEGY, "bigtrain", LONG_STEPS, "longest",
                              f"{tokens} tokens", sets=EVERY_LEVER + ladder.sets))
    return cases


def longest_table(rows: list[dict], device_bytes: float | None, headroom: float = 0.1) -> str:
    """Per ladder: each rung (trained, or out of memory), its peak device memory and step time; the slope between
    the two longest rungs that trained and the length it extrapolates to under (1 - headroom) of the device."""
    from bigtrain.bench.table import markdown_table
    from bigtrain.metrics import format_bytes
    body = []
    for model in dict.fromkeys(r["workload"] for r in rows if r.get("group") == "longest"):
        rungs = [r for r in rows if r.get("group") == "longest" and r["workload"] == model]
        trained = sorted((r for r in rungs if r.get("ok")), key=lambda r: r["tokens_per_sample"])
        note = ""
        if len(trained) >= 2 and device_bytes:
            a, b = trained[-2], trained[-1]
            slope = (b["peak_rss_bytes"] - a["peak_rss_bytes"]) / (b["tokens_per_sample"] - a["tokens_per_sample"])
            if slope > 0:
                longest = b["tokens_per_sample"] + ((1 - headroom) * device_bytes - b["peak_rss_bytes"]) / slope
                note = f"{slope / 1024:.1f} KiB/token: ~{longest / 1024:.0f}K tokens fit"
        for r in rungs:
            what = (f"{r['step_s']:.1f} s/step" if r.get("ok") else
                    "out of memory" if r.get("out_of_memory") else f"failed: {r.get('error', '?')[:50]}")
            body.append([model, r["strategy"], r["setting"].split()[0],
                         format_bytes(r["peak_rss_bytes"]) if r.get("ok") else "-", what,
                         note if trained and r is trained[-1] else ""])
    header = ["model", "strategy", "tokens", "peak device memory", "step", "per token, and the longest it extrapolates"]
    return markdown_table(header, body)
