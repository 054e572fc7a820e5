"""Model zoo: registry errors, parameter counts, FLOPs formulas, and the pipeline form
equalling the plain module (same loss and gradients from the same weights)."""
from __future__ import annotations

import pathlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bigtrain.models import (SequentialPipeline, build, call_module, families, module_state_from_pipeline,
                             pipeline_state_from_module)

TOKENS = torch.Generator().manual_seed(0)


def text_batch(vocab: int, b: int = 2, t: int = 16) -> dict:
    ids = torch.randint(0, vocab, (b, t), generator=TOKENS)
    return {"input_ids": ids, "labels": ids}


def tiny_cases() -> list[tuple[str, str, dict, dict]]:
    """(family, size, overrides, batch): every family at a tiny size, plus a bottleneck ResNet."""
    gen = torch.Generator().manual_seed(1)
    return [
        ("gpt2", "tiny", {"vocab_size": 256}, text_batch(256)),
        ("gpt2", "tiny", {"vocab_size": 256, "attn_implementation": "eager"}, text_batch(256)),
        ("encoder", "tiny", {"vocab_size": 256, "n_positions": 32, "num_classes": 3},
         {"input_ids": torch.randint(0, 256, (2, 16), generator=gen), "labels": torch.tensor([0, 2])}),
        ("encoder", "tiny", {"vocab_size": 256, "n_positions": 32, "num_classes": 2},  # padded text, with its mask
         {"input_ids": torch.randint(0, 256, (2, 16), generator=gen), "labels": torch.tensor([1, 0]),
          "attention_mask": torch.tensor([[1] * 16, [1] * 9 + [0] * 7])}),
        ("llama", "tiny", {"vocab_size": 256}, text_batch(256)),  # grouped-query attention, untied head
        ("llama", "tiny", {"vocab_size": 256, "tie_embeddings": True, "n_kv_head": 1}, text_batch(256)),
        ("resnet", "tiny", {},
         {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen), "labels": torch.tensor([1, 7])}),
        ("resnet", "50", {"width": 8, "image_size": 64, "num_classes": 5},
         {"pixel_values": torch.randn(2, 3, 64, 64, generator=gen), "labels": torch.tensor([4, 0])}),
    ]


def test_families_list_named_sizes():
    fams = families()
    assert fams["gpt2"] == ["tiny", "mini", "small", "medium", "large", "xl", "custom"]
    assert fams["resnet"] == ["tiny", "18", "34", "50", "101", "152", "custom"]
    assert fams["encoder"][:2] == ["tiny", "mini"] and fams["encoder"][-1] == "custom"


@pytest.mark.parametrize("args, kwargs, message", [
    (("vit", "tiny"), {}, "unknown model family 'vit'; choose one of: encoder, gpt2, hf, llama, resnet"),
    (("gpt2", "huge"), {}, "unknown size 'huge' for gpt2; choose one of: tiny, mini, small"),
    (("gpt2", "tiny"), {"n_layers": 3}, "unknown override(s) n_layers for gpt2; allowed: attn_implementation, dropout"),
    (("resnet", "18"), {"classes": 3}, "allowed: block, cifar_stem, image_size, layers, num_classes, width"),
    (("gpt2", "custom"), {"n_layer": 2}, "gpt2 size 'custom' needs overrides n_embd, n_head"),
    (("resnet", "custom"), {}, "resnet size 'custom' needs overrides block"),
    (("encoder", "custom"), {"n_layer": 2, "n_embd": 30, "n_head": 4}, "n_embd=30 is not divisible by n_head=4"),
    (("gpt2", "tiny"), {"seq_len": 512}, "gpt2 seq_len=512 exceeds n_positions=128"),
    (("resnet", "custom"), {"block": "basic", "layers": (2, 2)}, "give four positive block counts"),
    (("gpt2", "tiny"), {"attn_implementation": "flash"}, "use 'sdpa' or 'eager'"),
])
def test_user_mistakes_are_clear_value_errors(args, kwargs, message):
    with pytest.raises(ValueError) as err:
        build(*args, **kwargs)
    assert message in str(err.value)


def test_bad_batch_names_the_expected_keys():
    with pytest.raises(ValueError, match="gpt2 batches need keys 'input_ids' and 'labels'; got \\['text'\\]"):
        build("gpt2", "tiny").batch_to_inputs({"text": None})
    with pytest.raises(ValueError, match="resnet batches need keys 'pixel_values' and 'labels'"):
        build("resnet", "tiny").batch_to_inputs({"input_ids": None, "labels": None})


def meta_count(spec) -> int:
    with torch.device("meta"):  # shapes only: GPT-2 small etc. in milliseconds
        module = spec.build()
    return sum(p.numel() for p in module.parameters())  # tied weights counted once


@pytest.mark.parametrize("size, expected", [
    ("18", 11_689_512), ("34", 21_797_672), ("50", 25_557_032), ("101", 44_549_160), ("152", 60_192_808)])
def test_resnet_parameter_counts_match_the_reference(size, expected):
    spec = build("resnet", size, num_classes=1000)
    assert spec.num_params == expected
    assert meta_count(spec) == expected


@pytest.mark.parametrize("size, expected", [
    ("small", 124_439_808), ("medium", 354_823_168), ("large", 774_030_080), ("xl", 1_557_611_200)])
def test_gpt2_parameter_counts_match_the_reference(size, expected):
    spec = build("gpt2", size)
    assert spec.num_params == expected
    assert meta_count(spec) == expected


def test_other_sizes_count_what_they_build():
    for fam, size, overrides in [("gpt2", "mini", {"vocab_size": 4096}), ("encoder", "base", {}),
                                 ("resnet", "tiny", {}), ("resnet", "18", {"cifar_stem": True, "num_classes": 10})]:
        spec = build(fam, size, **overrides)
        assert spec.num_params == meta_count(spec), (fam, size)
    assert build("encoder", "base").num_params == 109_482_242  # HF BERT-base classifier minus token types


@pytest.mark.parametrize("case", range(len(tiny_cases())))
def test_pipeline_layers_equal_the_plain_module(case):
    family, size, overrides, batch = tiny_cases()[case]
    spec = build(family, size, **overrides)
    torch.manual_seed(0)
    plain = spec.build()
    pipe = SequentialPipeline(spec)
    pipe.load_layer_states(pipeline_state_from_module(spec, plain.state_dict()))
    inputs, labels = spec.batch_to_inputs(batch)

    plain_loss = spec.loss(call_module(plain, inputs), labels)
    pipe_loss = spec.pipeline_loss(pipe(inputs), labels)
    plain_loss.backward()
    pipe_loss.backward()

    assert plain_loss.item() > 0.1
    assert abs(plain_loss.item() - pipe_loss.item()) <= 1e-6
    pipe_grads = module_state_from_pipeline(spec, pipe.layer_states(grads=True))
    for name, param in plain.named_parameters():
        assert param.grad.abs().sum() > 0, name
        torch.testing.assert_close(pipe_grads[name], param.grad, rtol=0, atol=1e-6, msg=name)
    if family == "resnet":  # BatchNorm running stats moved the same way in both forms
        back = module_state_from_pipeline(spec, pipe.layer_states())
        for name, buf in plain.named_buffers():
            torch.testing.assert_close(back[name], buf, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", range(len(tiny_cases())))
def test_state_dict_round_trip_through_pipeline_layers(case):
    family, size, overrides, _ = tiny_cases()[case]
    spec = build(family, size, **overrides)
    state = spec.build().state_dict()
    layers = pipeline_state_from_module(spec, state)
    back = module_state_from_pipeline(spec, layers)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    if family == "gpt2":  # the tied embedding is stored once, by the first layer
        assert sum("weight" in s and s["weight"].shape[0] == 256 for s in layers.values()) == 1
        assert back["lm_head.weight"] is back["transformer.wte.weight"]
    if family == "llama" and overrides.get("tie_embeddings"):
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


def test_foreign_state_dict_is_rejected():
    spec = build("gpt2", "tiny", vocab_size=256)
    state = build("encoder", "tiny", vocab_size=256).build().state_dict()
    with pytest.raises(ValueError, match="map to no pipeline layer"):
        pipeline_state_from_module(spec, state)


def measured_flops_per_sample(spec, batch: dict) -> float:
    """FlopCounterMode's count of one forward + backward, per sample.

    The counter counts matmuls and convolutions only (2 FLOPs per multiply-add), which is
    what the formulas count. SDPA runs on its math backend so that its matmuls are seen
    (the counter has no rule for the fused CPU kernel).
    """
    torch.manual_seed(0)
    module = spec.build()
    inputs, labels = spec.batch_to_inputs(batch)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        spec.loss(call_module(module, inputs), labels).backward()
    return counter.get_total_flops() / labels.shape[0]


@pytest.mark.parametrize("family, size, overrides, batch", [
    # GPT-2: 6N + 12*L*h*s per token against the counter's fwd+bwd total; with h=64 the
    # attention term is ~13% of the total, so the formula's two parts are both checked.
    ("gpt2", "tiny", {"vocab_size": 512, "seq_len": 64}, lambda: text_batch(512, 2, 64)),
    ("gpt2", "custom", {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1024, "seq_len": 128,
                        "n_positions": 128}, lambda: text_batch(1024, 2, 128)),
    ("encoder", "tiny", {"vocab_size": 512, "n_positions": 64},
     lambda: {"input_ids": torch.randint(0, 512, (2, 64), generator=TOKENS), "labels": torch.tensor([0, 1])}),
    # ResNet: convs + classifier, training = 3x forward. The counter sees no input gradient
    # for the first conv (its input needs none): the convention overcounts by that, 1% for
    # ResNet-50 (more at toy widths, where the stem weighs more).
    # Llama: SwiGLU and grouped-query attention (2 key/value heads for 4 query heads), untied and tied head.
    ("llama", "tiny", {"vocab_size": 512, "seq_len": 64}, lambda: text_batch(512, 2, 64)),
    ("llama", "custom", {"n_layer": 2, "n_embd": 128, "n_head": 8, "n_kv_head": 2, "intermediate_size": 320,
                         "vocab_size": 256, "seq_len": 128, "n_positions": 128, "tie_embeddings": True},
     lambda: text_batch(256, 2, 128)),
    ("resnet", "tiny", {}, lambda: {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 2])}),
    ("resnet", "50", {"image_size": 64, "num_classes": 10},
     lambda: {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.tensor([1, 2])}),
    ("resnet", "18", {"image_size": 64, "num_classes": 10},
     lambda: {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.tensor([1, 2])}),
])
def test_flops_formula_matches_flop_counter(family, size, overrides, batch):
    spec = build(family, size, **overrides)
    measured = measured_flops_per_sample(spec, batch())
    assert abs(spec.flops_per_sample - measured) / measured < 0.05, (spec.flops_per_sample, measured)


def test_gpt2_flops_scale_with_sequence_length():
    short, long = build("gpt2", "small", seq_len=256), build("gpt2", "small")
    assert (short.tokens_per_sample, long.tokens_per_sample) == (256, 1024)
    per_token = lambda s: s.flops_per_sample / s.tokens_per_sample  # noqa: E731
    assert per_token(long) - per_token(short) == 12 * 12 * 768 * (1024 - 256)
    assert per_token(short) == 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 768 * 256


def test_gpt2_loss_is_hf_causal_lm_loss():
    spec = build("gpt2", "tiny", vocab_size=256)
    model = spec.build()
    assert model.loss_type == "ForCausalLM" and not model.config.use_cache
    batch = text_batch(256)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, :5] = -100  # ignored positions (padding) count in neither loss
    inputs, labels = spec.batch_to_inputs(batch)
    hf = model(inputs, labels=labels)
    torch.testing.assert_close(spec.loss(hf, labels), hf.loss, rtol=0, atol=1e-6)


def test_gpt2_pretrained_from_local_directory(tmp_path: pathlib.Path):
    spec = build("gpt2", "tiny", vocab_size=256)
    torch.manual_seed(3)
    saved = spec.build()
    saved.save_pretrained(tmp_path)
    loaded_spec = build("gpt2", "tiny", vocab_size=256, pretrained=str(tmp_path), dropout=0.1)
    loaded = loaded_spec.build()
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert loaded.config.resid_pdrop == 0.1
    custom = build("gpt2", "custom", pretrained=str(tmp_path))
    assert custom.num_params == spec.num_params
    with pytest.raises(ValueError, match="but .* has n_layer=2; use size='custom'"):
        build("gpt2", "mini", pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="no such directory"):
        build("gpt2", "tiny", pretrained=str(tmp_path / "missing"))


def test_models_table_for_the_cli():
    from bigtrain.models.cli import table
    rows = table(None, {}).splitlines()
    assert any(r.split()[:3] == ["resnet", "50", "25.56M"] for r in rows)
    assert any(r.split()[:3] == ["gpt2", "small", "124.44M"] for r in rows)
    short = table("gpt2", {"seq_len": 256}).splitlines()
    assert short[1].split()[:3] == ["gpt2", "tiny", "skipped:"], short  # the size skipped, and the numbers that clash
    assert "seq_len=256" in short[1] and "n_positions=128" in short[1], short
    with pytest.raises(ValueError, match="unknown override\\(s\\) depth for resnet"):
        table("resnet", {"depth": 3})


def test_models_package_never_imports_deepspeed():
    root = pathlib.Path(__file__).resolve().parents[2] / "bigtrain" / "models"
    offenders = [p.name for p in root.glob("*.py") if "import deepspeed" in p.read_text()
                 or "from deepspeed" in p.read_text()]
    assert offenders == []
    assert len(list(root.glob("*.py"))) >= 6


def test_gpt2_vocab_multiple_pads_the_output_layer_and_samples_skip_the_padding(tmp_path: pathlib.Path):
    from bigtrain.train.sample import generate_sample
    spec = build("gpt2", "tiny", vocab_size=250, vocab_multiple=64)
    plain = build("gpt2", "tiny", vocab_size=250)
    assert spec.config.vocab_size == 256 and spec.num_params == plain.num_params + 6 * spec.config.n_embd
    torch.manual_seed(0)
    model = spec.build()
    with torch.no_grad():  # padded rows whose logits would dominate every top-k if they were not suppressed
        model.transformer.wte.weight[250:] = 1000 * torch.randn(6, spec.config.n_embd)

    class Tokenizer:  # the 250-token vocabulary the data has
        eos_token_id = None

        def __len__(self):
            return 250

        def __call__(self, text, return_tensors):
            return {"input_ids": torch.tensor([[1, 2, 3]])}

        def decode(self, ids, skip_special_tokens):
            seen.extend(ids.tolist())
            return ""

    seen: list[int] = []
    generate_sample(model.eval(), Tokenizer(), max_new_tokens=24, device="cpu")
    assert len(seen) == 27 and max(seen) < 250
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="would pad the pretrained vocabulary 256"):
        build("gpt2", "custom", pretrained=str(tmp_path), vocab_multiple=100)
    assert build("gpt2", "custom", pretrained=str(tmp_path), vocab_multiple=64).config.vocab_size == 256
    with pytest.raises(ValueError, match="vocab_multiple=0: must be a positive integer"):
        build("gpt2", "tiny", vocab_multiple=0)


def test_a_chat_runs_sample_answers_one_turn(tmp_path: pathlib.Path):
    """The end-of-run sample of a chat run continues a held-out prompt up to its answer: it stops at the token the
    chat template closes a turn with (Qwen's <|im_end|>, Llama 3's <|eot_id|>), not only at the end-of-text, as
    `bigtrain generate` does (it went on into made-up turns)."""
    from transformers import AutoModelForCausalLM

    from bigtrain.train.sample import generate_sample
    from local_chat import make_chat_tokenizer
    from local_hf import decoder_config
    tok = make_chat_tokenizer(tmp_path)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert eot != tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(decoder_config("llama", len(tok))).eval()
    head = torch.nn.Linear(model.config.hidden_size, len(tok))  # every next token: the end of the turn
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1000.0)
        head.bias[eot] = 1000.0
    model.lm_head = head
    prompt = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True,
                                     return_dict=False)
    text = generate_sample(model, tok, max_new_tokens=8, device="cpu", prompt_ids=list(prompt))
    assert text == tok.decode(prompt) + "<|eot_id|>", text


@pytest.mark.parametrize("case", [0, 2, 3, 4, 5, 6])  # gpt2, encoder (+ mask), llama (untied, tied), resnet
def test_every_build_path_starts_from_the_same_weights(case):
    """The plain module and the pipeline layers draw the same weights from the same seed (a module's
    weights depend on the seed and its name only), another seed gives others, the global RNG is untouched."""
    family, size, overrides, _ = tiny_cases()[case]
    spec = build(family, size, **overrides)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    plain = spec.build(seed=7).state_dict()
    pipe = module_state_from_pipeline(spec, SequentialPipeline(spec, seed=7).layer_states())
    assert torch.equal(torch.get_rng_state(), before)
    assert set(pipe) == set(plain)
    assert all(torch.equal(pipe[k], plain[k]) for k in plain)
    other = spec.build(seed=8).state_dict()
    weights = [k for k, v in plain.items() if v.is_floating_point() and v.dim() > 1]
    assert weights and all(not torch.equal(other[k], plain[k]) for k in weights)


@pytest.mark.parametrize("size, expected", [
    ("1b", 1_235_814_400), ("3b", 3_212_749_824), ("8b", 8_030_261_248), ("70b", 70_553_706_496)])
def test_llama_parameter_counts_match_the_released_models(size, expected):
    """Llama 3.2 1B / 3B (tied embeddings) and Llama 3.1 8B / 70B (untied), as their model cards count them."""
    spec = build("llama", size)
    assert spec.num_params == expected
    if size in ("1b", "8b"):
        assert meta_count(spec) == expected
    cfg = spec.config
    assert (cfg.num_key_value_heads, cfg.vocab_size, cfg.rope_parameters["rope_type"]) == (8, 128256, "llama3")


def test_llama_flops_count_swiglu_and_grouped_query_attention():
    """6N + 12*L*w*s: N holds 3 SwiGLU matrices per layer and k/v at n_kv_head/n_head of q's width; the
    untied input embedding is a lookup (not in N), the tied one counts once, as the head."""
    untied = build("llama", "tiny", vocab_size=512, seq_len=64)
    tied = build("llama", "tiny", vocab_size=512, seq_len=64, tie_embeddings=True)
    h, inner, layers, seq = 64, 176, 2, 64
    per_layer = h * h * 2 + 2 * h * (h // 2) + 3 * h * inner + 2 * h  # q, o; k, v at 2 of 4 heads; SwiGLU; norms
    n = 512 * h + layers * per_layer + h
    assert untied.num_params == n + 512 * h and tied.num_params == n
    attention = 12 * layers * h * seq
    assert untied.flops_per_sample == tied.flops_per_sample == seq * (6 * n + attention)


def test_encoder_ignores_what_padding_holds():
    """With the attention mask a text's logits do not depend on the padding after it."""
    spec = build("transformer", "tiny", vocab_size=256, n_positions=32, num_classes=2)
    assert spec.family == "encoder" and spec.eval_metric == "accuracy"
    model = spec.build(seed=0).eval()
    ids = torch.randint(3, 256, (1, 16), generator=TOKENS)
    other = ids.clone()
    other[0, 9:] = torch.randint(3, 256, (7,), generator=TOKENS)
    mask = torch.tensor([[1] * 9 + [0] * 7])
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask), model(other, attention_mask=mask)
        unmasked = model(other)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert (unmasked - a).abs().max() > 1e-4


def test_no_branch_on_a_family_name_outside_models():
    """A family is one object (`bigtrain.models.family.Family`): code outside bigtrain/models asks it, never
    compares a family's name (`family == "gpt2"`, `family in ("gpt2", "llama")`)."""
    import ast
    from pathlib import Path

    from bigtrain.models.names import ALIASES
    from bigtrain.models.registry import families
    names = set(families()) | set(ALIASES)
    package = Path(__file__).resolve().parents[2] / "bigtrain"
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(package / "models"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            constants = [c for side in sides for c in ([side] if not isinstance(side, (ast.Tuple, ast.List, ast.Set))
                                                       else side.elts)
                         if isinstance(c, ast.Constant) and c.value in names]
            if constants:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert found == [], f"branches on a family name outside bigtrain/models: {found}"
