"""objective.decode=compact (bigtrain/rollout/decode.py): a completion that ended leaves the batch and the KV cache.
Held to transformers' generate (objective.decode=generate) on a tiny Llama whose end-of-text is made likely enough
that completions end at mixed lengths: greedy decoding gives generate's completions to the last token (a wrong
cache row kept after a row left, or a position id off, would change the later tokens of the rows still decoding);
sampling gives generate's completions under the same seed until the first one ends, through the same warpers
(temperature, top-k, top-p)."""
from __future__ import annotations

import pytest
import torch

from bigtrain.rollout.generate import SampleRNG, Sampling, generate

from test_rollout_generate import EOS, PAD, TOKENIZER, VOCAB, tiny_llama

NEW = 12


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """8 prompts of 2-6 tokens, left-padded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(EOS + 1, VOCAB, (8, 6), generator=g)
    mask = (torch.arange(6) >= torch.arange(8).unsqueeze(1) % 5).long()
    return ids.masked_fill(mask == 0, PAD), mask


def tiny_gpt2():
    """GPT-2's learned positions make every token depend on its position id: a position off shows at once."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    """A tiny model with its end-of-text's logit raised so that greedy decoding ends some completions early and not
    others (the raise set from the model's own logits: EOS the likeliest at about a third of positions)."""
    m = (tiny_llama() if request.param == "llama" else tiny_gpt2()).eval()
    ids, mask = prompts()
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=mask).logits
    others = logits.clone()
    others[..., EOS] = -torch.inf
    gap = (others.max(-1).values - logits[..., EOS]).flatten()
    bump = torch.zeros(logits.shape[-1])
    bump[EOS] = float(torch.quantile(gap, 0.3))
    m.lm_head.register_forward_hook(lambda module, args, out: out + bump)
    return m


def rollout(model, decode: str, seed: int = 0, **sampling):
    settings = {"max_new_tokens": NEW, "temperature": 1.0, "num_generations": 2, **sampling}
    ids, mask = prompts()
    return generate(model, TOKENIZER, ids, mask, Sampling(**settings, decode=decode), SampleRNG(seed, 0, "cpu"))


def test_greedy_compact_decoding_is_generates_to_the_last_token_with_completions_of_mixed_lengths(model):
    compact, padded = (rollout(model, d, temperature=0.0, num_generations=1) for d in ("compact", "generate"))
    lengths = compact.lengths.tolist()
    assert len(set(lengths)) > 1 and min(lengths) < NEW and compact.truncated.any()  # rows left at different steps
    assert compact.completion_lists() == padded.completion_lists()
    assert torch.equal(compact.completion_mask, padded.completion_mask)


@pytest.mark.parametrize("warp", [{}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9}])
def test_sampled_compact_decoding_is_generates_under_the_same_seed_until_the_first_completion_ends(model, warp):
    compact, padded = (rollout(model, d, seed=3, **warp) for d in ("compact", "generate"))
    first_end = int(torch.minimum(compact.lengths, padded.lengths).min())
    assert 1 <= first_end < NEW, first_end  # some completion ended: the batches shrank after it
    assert torch.equal(compact.completion_ids[:, :first_end], padded.completion_ids[:, :first_end])
    # after the first end the draws differ (a smaller batch draws other numbers), the lengths still mixed
    assert len(set(compact.lengths.tolist())) > 1


def test_compact_is_the_default_and_generate_a_setting():
    from bigtrain.config.load import load_run_config
    base = ["objective.kind=grpo", "objective.rewards=accuracy", "data.seq_len=1024"]
    assert Sampling(max_new_tokens=4).decode == "compact" == load_run_config(None, base).objective.decode
    assert load_run_config(None, base + ["objective.decode=generate"]).objective.decode == "generate"
    with pytest.raises(ValueError, match="objective.decode='paged': allowed values are compact, generate"):
        load_run_config(None, base + ["objective.decode=paged"])


def test_with_partitioned_weights_a_rank_whose_completions_ended_runs_a_placeholder_until_every_rank_has(model,
                                                                                                        monkeypatch):
    """synced (ZeRO-3 weights left partitioned: every forward gathers each layer on every rank together): played here
    with another rank that decodes 3 steps longer. This rank's completions are those of an unsynced round, it runs
    3 more forwards, and its placeholder draws nothing from the sampling stream."""
    import bigtrain.rollout.decode as decode
    ids, mask = prompts()
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    forwards = []
    hooks = [model.register_forward_hook(lambda *args: forwards.append(1)),  # and every completion ends soon:
             model.get_output_embeddings().register_forward_hook(lambda m, a, out: out + 3.0 * (
                 torch.arange(out.shape[-1]) == EOS))]
    runs = []
    for synced in (False, True):
        others = iter([True] * 3 + [False])  # the other rank: still going at 3 more of this rank's checks
        monkeypatch.setattr(decode, "_anyone_decoding", lambda mine, device: mine or next(others))
        forwards.clear()
        torch.manual_seed(5)
        out = decode.compact_decode(model, ids, mask, 40, [EOS], PAD, greedy=False, synced=synced,
                                    cache_keyword="cache" if decode_takes_cache(model) else "past_key_values")
        runs.append((out, len(forwards), torch.get_rng_state()))
    for hook in hooks:
        hook.remove()
    (alone, n_alone, rng_alone), (synced, n_synced, rng_synced) = runs
    assert n_alone < 40 and torch.equal(alone, synced) and torch.equal(rng_alone, rng_synced)
    assert n_synced == n_alone + 3


def decode_takes_cache(model) -> bool:
    from bigtrain.rollout.forward import takes
    return takes(model, "cache")
