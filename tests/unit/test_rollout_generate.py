"""Generation on a plain or peft module (bigtrain/rollout/generate.py, forward.py), one process: what the 1-2 rank
DeepSpeed checks (tests/dist/test_rollout_generation.py) take for granted. Each would catch: LoRA adapters left
out of generation; dropout during generation or the policy left in eval mode after; the model's own
generation_config (a repetition penalty, sampling switched on) changing what is drawn; the sampler disturbing the
process's global random stream (dropout, data order); a completion not cut at a second end-of-text id; groups out
of order; log-probs read one position off."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bigtrain.rollout.forward import completion_logits
from bigtrain.rollout.generate import SampleRNG, Sampling, generate, stop_ids
from bigtrain.rollout.losses import token_logps
from bigtrain.rollout.metrics import completion_metrics

PAD, EOS, VOCAB = 0, 3, 96
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, name_or_path="test")


def tiny_llama(dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_dropout=dropout, pad_token_id=PAD, eos_token_id=EOS))


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[PAD, PAD, 10, 11, 12], [20, 21, 22, 23, 24], [PAD, PAD, PAD, 30, 31]])
    return ids, (ids != PAD).long()


def plain_greedy(model, new: int = 6) -> list[list[int]]:
    """transformers' generate, each prompt alone, without any generation_config of the model's."""
    from transformers import GenerationConfig
    ids, mask = prompts()
    out = []
    for row, m in zip(ids, mask):
        prompt = row[m.bool()].unsqueeze(0)
        config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
        tokens = model.generate(prompt, generation_config=config)[0, prompt.shape[1]:].tolist()
        out.append(tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens)
    return out


def ours(model, sampling=Sampling(max_new_tokens=6, temperature=0.0), rng=None, **kw):
    ids, mask = prompts()
    return generate(model, TOKENIZER, ids, mask, sampling, rng or SampleRNG(0, 0, "cpu"), **kw)


def test_greedy_equals_transformers_and_log_probs_are_the_models():
    model = tiny_llama().eval()
    rollout = ours(model, logps=True)
    assert rollout.completion_lists() == plain_greedy(model)
    # the log-probs: one full forward over each prompt alone and its completion
    for i, tokens in enumerate(rollout.completion_lists()):
        prompt = prompts()[0][i][prompts()[1][i].bool()].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(rollout.logps[i, :len(tokens)], expected, atol=1e-5)
        assert (rollout.logps[i, len(tokens):] == 0).all()


def test_lora_adapters_generate_and_are_active():
    from peft import LoraConfig, get_peft_model
    base = tiny_llama()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # peft starts B at 0: an adapter that changes nothing would prove nothing
    got = ours(model).completion_lists()
    with model.disable_adapter():
        without = plain_greedy(model)
    merged = model.merge_and_unload().eval()
    assert got == plain_greedy(merged)
    assert got != without


def test_eval_mode_for_the_round_and_training_mode_after():
    model = tiny_llama(dropout=0.5).train()
    got = ours(model).completion_lists()
    assert model.training and all(m.training for m in model.modules())
    assert got == plain_greedy(model.eval())


def test_the_models_generation_config_is_set_aside():
    model = tiny_llama().eval()
    clean = plain_greedy(model)
    model.generation_config.repetition_penalty = 50.0
    model.generation_config.do_sample = True
    model.generation_config.top_k = 1
    with torch.no_grad():
        leaked = model.generate(prompts()[0][1:2], max_new_tokens=6)[0, 5:].tolist()
    assert leaked[:len(clean[1])] != clean[1]  # the config would change the completion
    assert ours(model).completion_lists() == clean
    assert model.generation_config.repetition_penalty == 50.0  # and is the model's again after


def test_sampling_is_a_stream_of_its_own():
    model = tiny_llama().eval()
    sampling = Sampling(max_new_tokens=6, temperature=0.9, top_p=0.95, num_generations=3)
    torch.manual_seed(42)
    rollout = ours(model, sampling, SampleRNG(5, 1, "cpu"))
    after = torch.rand(4)
    torch.manual_seed(42)
    assert torch.equal(torch.rand(4), after)  # the global stream did not move
    again = ours(model, sampling, SampleRNG(5, 1, "cpu"))
    other_rank = ours(model, sampling, SampleRNG(5, 0, "cpu"))
    assert again.completion_lists() == rollout.completion_lists()
    assert other_rank.completion_lists() != rollout.completion_lists()
    ids, _ = prompts()
    assert torch.equal(rollout.prompt_ids, ids.repeat_interleave(3, dim=0))  # groups: prompt g's rows together


def test_completions_end_at_any_stop_id():
    model = tiny_llama().eval()
    free = ours(model, Sampling(max_new_tokens=6, temperature=0.0))
    second_stop = free.completion_lists()[0][2]  # a token the first completion produces third
    model.generation_config.eos_token_id = [EOS, second_stop]  # as Llama 3 lists <|eot_id|> beside <|end_of_text|>
    assert stop_ids(model, TOKENIZER) == [EOS, second_stop]
    cut = ours(model, Sampling(max_new_tokens=6, temperature=0.0))
    first = cut.completion_lists()[0]
    assert first == free.completion_lists()[0][:3] and not cut.truncated[0]
    assert cut.completion_mask[0].tolist() == [1, 1, 1] + [0] * (cut.completion_ids.shape[1] - 3)
    assert (cut.completion_ids[0, 3:] == PAD).all()
    assert cut.truncated.tolist() == [second_stop not in c and EOS not in c for c in cut.completion_lists()]
    with pytest.raises(ValueError, match="no end-of-text"):
        model.generation_config.eos_token_id = None
        stop_ids(model, SimpleNamespace(eos_token_id=None, name_or_path="x"))


def test_completion_logits_predict_the_completion():
    model = tiny_llama().eval()
    rollout = ours(model)
    with torch.no_grad():
        logits = completion_logits(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                   rollout.completion_mask)
    greedy = logits.argmax(-1)  # greedy tokens are the argmax of the logits that predict them
    assert torch.equal(greedy * rollout.completion_mask, rollout.completion_ids * rollout.completion_mask)
    assert token_logps(logits, rollout.completion_ids).shape == rollout.completion_ids.shape


def test_truncated_completions_masked_and_completion_metrics():
    """mask_truncated_completions zeroes a cut completion's mask (not its tokens); TRL's completions/* metrics."""
    model = tiny_llama().eval()
    free = ours(model, Sampling(max_new_tokens=6, temperature=0.0))
    model.generation_config.eos_token_id = [EOS, free.completion_lists()[0][2]]  # the first completion ends at 3
    rollout = ours(model, Sampling(max_new_tokens=6, temperature=0.0))
    assert not rollout.truncated[0] and rollout.truncated.any()
    masked = rollout.masked_truncated()
    assert masked.completion_mask[rollout.truncated].sum() == 0
    assert torch.equal(masked.completion_mask[~rollout.truncated], rollout.completion_mask[~rollout.truncated])
    assert torch.equal(masked.completion_ids, rollout.completion_ids)
    lengths = [len(c) for c in rollout.completion_lists()]
    metrics = completion_metrics(rollout.lengths, rollout.truncated)
    assert metrics == {"completions/mean_length": pytest.approx(sum(lengths) / len(lengths)),
                       "completions/min_length": min(lengths), "completions/max_length": max(lengths),
                       "completions/clipped_ratio": pytest.approx(rollout.truncated.float().mean().item())}
