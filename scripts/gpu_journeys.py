"""Fine-tuning journeys run to their exit on one device, the way a user runs them, with what each
showed written to a JSON file after every step:

1. a Llama-style directory made here (random weights, a byte-level BPE with Llama 3's chat template, saved
   with `save_pretrained`) fine-tuned on chat data with LoRA at ZeRO-3, packed, bf16: stopped half-way
   (`--stop-after`), resumed to the end (`--resume`), and the same run uninterrupted for comparison;
2. the resumed run exported with its adapters merged and as a peft adapter, both loaded back with
   transformers / peft, their logits compared, and a reply generated from a chat prompt;
3. DPO with LoRA at ZeRO-3 on pairs made from the same chats (the chosen answer the chat's own, the rejected one
   another chat's), its first loss (ln 2: the policy is the reference), its exit, its merged export reloaded;
4. packing against no packing on the same chats: real (non-padding) tokens per second.

    python scripts/gpu_journeys.py --out DIR            # on a GPU host (sizes below)
    python scripts/gpu_journeys.py --out DIR --tiny     # the same journeys on a CPU, tiny sizes (rehearsal)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_packing  # noqa: E402  (scripts/: the packing run lives there)
from bigtrain.bench.chat_data import make_base  # noqa: E402

GPU = {"hidden": 1024, "layers": 12, "heads": 16, "kv": 8, "ffn": 2816, "seq": 1024, "micro": 8, "steps": 20,
       "precision": "bf16", "examples": 2000}
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "ffn": 176, "seq": 256, "micro": 2, "steps": 6,
        "precision": "bf16", "examples": 300}


def bigtrain(args: list[str], timeout_s: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run([bench_packing.bigtrain_command(), *args], capture_output=True, text=True,
                              timeout=max(timeout_s, 30))
    except subprocess.TimeoutExpired as err:
        return {"rc": 124, "wall_s": round(time.perf_counter() - start, 1), "tail": str(err.stderr or "")[-1500:]}
    return {"rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "tail": (proc.stdout + proc.stderr)[-1500:]}


def sft_args(base: Path, data: Path, out: Path, size: dict) -> list[str]:
    sets = ["data.packing=true", "lora.r=16", "zero.stage=3", f"precision={size['precision']}",
            f"data.seq_len={size['seq']}", f"batch.micro_batch={size['micro']}", f"batch.global_batch={size['micro']}",
            "train.eval_interval=0", "train.eval_batches=2", "train.sample_tokens=16", "logging.progress_bar=false"]
    args = ["train", "--num-gpus", "1", "--model", "hf", "--set", f"model.pretrained={base}", "--data", str(data),
            "--steps", str(size["steps"]), "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    return args


def losses(run: Path) -> list[float]:
    return json.loads((run / "summary.json").read_text())["losses"]


def reload_exports(base: Path, merged: Path, adapter: Path) -> dict:
    """Load the merged export and base + adapter; the same logits, unlike the base's; a generated reply."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(str(merged))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What does the garbage collector do?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True).to(device)

    def load(path: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()

    with torch.no_grad():
        merged_model = load(merged)
        merged_logits = merged_model(**prompt).logits
        reply = merged_model.generate(**prompt, max_new_tokens=16, do_sample=False)
        new_tokens = reply[0, prompt["input_ids"].shape[1]:]
        base_logits = load(base)(**prompt).logits
        peft_model = PeftModel.from_pretrained(load(base), str(adapter)).eval()
        peft_logits = peft_model(**prompt).logits
    scale = merged_logits.abs().max().item()
    return {"merged_vs_peft_max_abs": (merged_logits - peft_logits).abs().max().item(),
            "merged_vs_base_max_abs": (merged_logits - base_logits).abs().max().item(), "logit_scale": scale,
            "finite": bool(torch.isfinite(merged_logits).all()), "generated_tokens": int(new_tokens.numel()),
            "reply": tok.decode(new_tokens, skip_special_tokens=True)}


def dpo_journey(root: Path, base: Path, chats: Path, size: dict, seconds: float) -> dict:
    """DPO from the base on pairs made of the chats, to its exit; its export reloaded with transformers."""
    pairs = bench_packing.make_pairs(chats, root / "pairs.jsonl")
    out, merged = root / "dpo", root / "dpo-merged"
    args = ["train", "--num-gpus", "1", "--model", "hf", "--set", f"model.pretrained={base}", "--data", str(pairs),
            "--steps", str(size["steps"]), "--out", str(out)]
    for item in ("objective.kind=dpo", "lora.r=16", "zero.stage=3", f"precision={size['precision']}",
                 f"data.seq_len={size['seq']}", f"batch.micro_batch={size['micro'] // 2}",
                 f"batch.global_batch={size['micro'] // 2}", "train.eval_interval=0", "train.eval_batches=2",
                 "logging.progress_bar=false"):
        args += ["--set", item]
    started = time.perf_counter()
    result = bigtrain(args, seconds)
    if result["rc"]:
        return result
    summary = json.loads((out / "summary.json").read_text())
    exported = bigtrain(["export", str(out), "--out", str(merged)], seconds - (time.perf_counter() - started))
    row = {"rc": exported["rc"], "first_loss": summary["losses"][0], "final_loss": summary["final_loss"],
           "final_metrics": summary.get("final_metrics"), "val_metrics": summary.get("val_metrics"),
           "tokens_per_s": summary.get("tokens_per_s"), "wall_s": result["wall_s"]}
    if not exported["rc"]:
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(merged))
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            row["export_reloaded_finite"] = bool(torch.isfinite(model(ids).logits).all())
    else:
        row["tail"] = exported["tail"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where journeys.json goes")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU rehearsal)")
    p.add_argument("--minutes", type=float, default=5.0, help="skip what is left after this long")
    args = p.parse_args()
    size = TINY if args.tiny else GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"started": time.strftime("%F %T"), "size": size, "steps": []}
    deadline = time.perf_counter() + 60 * args.minutes

    def record(name: str, result: dict) -> bool:
        report["steps"].append({"step": name, **result})
        (out / "journeys.json").write_text(json.dumps(report, indent=1))
        print(f"[journeys] {name}: {json.dumps({k: v for k, v in result.items() if k != 'tail'})}", flush=True)
        if result.get("rc", 0):
            print(result.get("tail", ""), flush=True)
        return not result.get("rc", 0)

    def left() -> float:
        return deadline - time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, tok_dir = bench_packing.make_data(root, examples=size["examples"])
        base = make_base(root, tok_dir, size)
        half = size["steps"] // 2
        resumed, whole = root / "sft", root / "sft-whole"
        ok = record("sft lora zero3 packed, stopped half-way",
                    bigtrain(sft_args(base, data, resumed, size) + ["--stop-after", str(half)], left()))
        ok = ok and record("sft resumed to the end",
                           bigtrain(sft_args(base, data, resumed, size) + ["--resume"], left()))
        if ok:
            summary = json.loads((resumed / "summary.json").read_text())
            record("resumed run's summary", {"steps": summary["steps"], "final_loss": summary["final_loss"],
                                             "tokens_per_s": summary.get("tokens_per_s"),
                                             "sample": summary.get("sample")})
            merged, adapter = root / "export-merged", root / "export-adapter"
            exported = record("export merged", bigtrain(["export", str(resumed), "--out", str(merged)], left()))
            exported = exported and record("export adapter", bigtrain(["export", str(resumed), "--out", str(adapter),
                                                                        "--adapter"], left()))
            if exported:
                record("exports reloaded", reload_exports(base, merged, adapter))
        if left() > 60:
            record("dpo lora zero3", dpo_journey(root, base, data, size, left()))
        sets = (f"model.overrides.n_layer={size['layers']}", f"model.overrides.n_embd={size['hidden']}",
                f"model.overrides.n_head={size['heads']}", f"model.overrides.n_kv_head={size['kv']}",
                f"model.overrides.intermediate_size={size['ffn']}", f"data.seq_len={size['seq']}",
                f"precision={size['precision']}", f"batch.micro_batch={size['micro']}",
                f"batch.global_batch={size['micro']}")
        for packed in (False, True):
            if left() < 45:
                record(f"packing={packed}", {"skipped": "past the time budget"})
                continue
            try:
                row = bench_packing.run(root, data, tok_dir, packed, size["steps"], f"packing-{packed}", sets,
                                        peak_tflops=989.0, timeout_s=max(left(), 30))
                record(f"packing={packed}", row)
            except (SystemExit, subprocess.TimeoutExpired) as err:
                record(f"packing={packed}", {"rc": 1, "tail": str(err)[-1500:]})
        if ok and left() > 60:
            if record("sft uninterrupted", bigtrain(sft_args(base, data, whole, size), left())):
                a, b = losses(resumed), losses(whole)
                record("resumed vs uninterrupted losses", {
                    "resumed": a, "uninterrupted": b,
                    "max_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) else None})
    failed = [s["step"] for s in report["steps"] if s.get("rc")]
    print(f"[journeys] done; failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
