"""The GPU speed levers as a CPU host can check them: the chunked causal-LM loss equals the plain
one, `batch.micro_batch=auto`'s search against a fake memory limit, and the defaults that depend on the
device (compile, loss, vocabulary padding) or on the precision (bf16 without overflow checks). That
`train.compile` trains the same losses as eager under the launcher: tests/dist/test_compile_training.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bigtrain import models
from bigtrain.models.chunked_loss import causal_lm_chunked_loss, causal_lm_hidden_loss, linear_cross_entropy
from bigtrain.models.losses import causal_lm_loss
from bigtrain.config.load import load_run_config
from bigtrain.ds.batch import largest_divisor_upto
from bigtrain.ds.lint import DeviceCaps
from bigtrain.ds.resolve import resolve
from bigtrain.ds.runtime import resolve_compile
from bigtrain.train import autobatch, fast_path
from messages import naming

TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("bias,chunk_rows", [(False, 7), (True, 5), (False, None)])
def test_chunked_loss_equals_the_plain_loss_in_fp32(bias, chunk_rows):
    torch.manual_seed(0)
    h = torch.randn(3, 17, 32, requires_grad=True)
    w = (0.3 * torch.randn(101, 32)).requires_grad_()
    b = torch.randn(101, requires_grad=True) if bias else None
    labels = torch.randint(0, 101, (3, 17))
    labels[0, 3] = labels[2, 9] = -100  # ignored targets count in neither the sum nor the mean
    plain = causal_lm_loss(F.linear(h, w, b), labels)
    inputs = [t for t in (h, w, b) if t is not None]
    expected = torch.autograd.grad(plain, inputs)
    chunked = causal_lm_chunked_loss(h, w, labels, b, chunk_rows=chunk_rows)
    got = torch.autograd.grad(chunked, inputs)
    assert abs(float(chunked.detach()) - float(plain.detach())) <= TOL * abs(float(plain.detach()))
    for name, e, g in zip("hwb", expected, got):
        assert g.dtype == e.dtype and _rel(g, e) <= TOL, (name, _rel(g, e))
    with torch.no_grad():  # evaluation: the loss alone, no gradient buffers
        assert abs(float(causal_lm_chunked_loss(h, w, labels, b, chunk_rows)) - float(plain)) <= TOL * float(plain)
    print(f"\nchunked vs plain loss: |d loss| {abs(float(chunked.detach()) - float(plain.detach())):.2e}, "
          f"max rel grad diff {max(_rel(g, e) for e, g in zip(expected, got)):.2e}")


def test_a_frozen_head_gets_no_gradient_buffer_and_the_input_its_gradient():
    """LoRA freezes the output head: the chunked loss makes no [vocabulary, hidden] fp32 gradient for it (4.9 GiB of
    buffer and transients for Llama-8B's head, counted with `LiveBytes`), and the hidden states' gradient is the
    plain loss's."""
    from bigtrain.estimate.live_bytes import LiveBytes
    torch.manual_seed(0)
    h, w = torch.randn(2, 16, 32, requires_grad=True), 0.3 * torch.randn(500, 32)
    labels = torch.randint(0, 500, (2, 16))
    expected = torch.autograd.grad(causal_lm_loss(F.linear(h, w), labels), h)[0]
    with LiveBytes() as watch:
        got = torch.autograd.grad(causal_lm_chunked_loss(h, w, labels, chunk_rows=8), h)[0]
    assert _rel(got, expected) <= TOL
    assert watch.snapshot().peak < w.numel() * 4  # less than the head's fp32 gradient alone


def test_chunked_loss_checks_its_inputs_and_never_builds_full_logits(monkeypatch):
    with pytest.raises(ValueError, match="expected hidden"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))
    widest = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: widest.append(x.shape[0]) or real_linear(x, w, b))
    h, w = torch.randn(64, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    linear_cross_entropy(h, w, torch.randint(0, 10, (64,)), chunk_rows=16).backward()
    assert widest == [16, 16, 16, 16]  # four chunks of logits, never the 64 rows at once


def test_chunked_loss_on_gpt2_equals_the_module_loss_with_padded_vocabulary():
    spec = models.build("gpt2", "tiny", vocab_size=500, vocab_multiple=64, seq_len=32)
    module = spec.build(seed=3)
    assert module.config.vocab_size == 512 and fast_path.chunked_unsupported(spec, module) is None
    x = torch.randint(0, 500, (2, 32))  # the padded rows 500..511 are never targets
    params = [p for p in module.parameters()]
    plain = spec.loss(module(x), x)
    expected = torch.autograd.grad(plain, params)
    chunked = causal_lm_hidden_loss(module, (x,), {}, x, chunk_rows=24)
    got = torch.autograd.grad(chunked, params)
    assert abs(float(chunked.detach()) - float(plain.detach())) <= TOL * float(plain.detach())
    worst = max(_rel(g, e) for e, g in zip(expected, got))
    assert worst <= TOL, worst


def test_fast_path_defaults_follow_the_device_and_refuse_what_cannot_run(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # tests/conftest.py sets it for the suite
    assert resolve_compile("auto", "cuda", 1, 1) == "torch"
    assert resolve_compile("auto", "cpu", 1, 1) == "off"
    assert resolve_compile("auto", "cuda", 2, 1) == "off"  # pipelines stay eager
    assert resolve_compile("auto", "cuda", 1, 3) == "off"  # ZeRO-3: opt in (true or deepcompile)
    assert resolve_compile(True, "cpu", 1, 3) == "torch" and resolve_compile(False, "cuda", 1, 1) == "off"
    assert resolve_compile("deepcompile", "cuda", 1, 3) == "deepcompile"
    with pytest.raises(ValueError, match="deepcompile needs an NVIDIA GPU"):
        resolve_compile("deepcompile", "cpu", 1, 1)
    with pytest.raises(ValueError, match="needs zero.stage 1, 2 or 3"):
        resolve_compile("deepcompile", "cuda", 1, 0)
    with pytest.raises(ValueError, match="pipeline.stages=2"):
        resolve_compile(True, "cuda", 2, 1)
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ValueError, match="train.compile=true on a CPU needs a C\\+\\+ compiler"):
        resolve_compile(True, "cpu", 1, 1)
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # torch.compile is a no-op: auto stays eager, an ask is refused
    assert resolve_compile("auto", "cuda", 1, 1) == "off"
    for setting in (True, "deepcompile"):
        with pytest.raises(ValueError) as refused:
            resolve_compile(setting, "cuda", 1, 1)
        assert naming(str(refused.value), "TORCHDYNAMO_DISABLE=1", "train.compile=false")
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    fake_gpu = DeviceCaps("cuda", fp16=True, bf16=True)
    run = load_run_config(None, ["train.compile=deepcompile", "zero.stage=1", "precision=bf16"])
    assert resolve(run, None, 1, fake_gpu).ds_config["compile"] == {"deepcompile": True}  # resolve writes it
    assert "compile" not in resolve(load_run_config(None, ["zero.stage=1", "precision=bf16"]), None, 1,
                                    fake_gpu).ds_config
    gpt2 = models.build("gpt2", "tiny", vocab_size=128, seq_len=16)
    module = gpt2.build(seed=0)
    assert fast_path.resolve_loss_impl("auto", "cuda", gpt2, module) == "chunked"
    assert fast_path.resolve_loss_impl("auto", "cpu", gpt2, module) == "plain"
    assert fast_path.resolve_loss_impl("auto", "cuda", gpt2, None) == "plain"  # a pipeline
    resnet = models.build("resnet", "tiny")
    with pytest.raises(ValueError, match="train.loss_impl=chunked: resnet is not trained with the causal-LM loss"):
        fast_path.resolve_loss_impl("chunked", "cuda", resnet, resnet.build(seed=0))


def test_loss_forward_keeps_the_module_and_its_own_forward():
    spec = models.build("gpt2", "tiny", vocab_size=128, seq_len=16)
    module = spec.build(seed=0)
    keys = list(module.state_dict())
    x = torch.randint(0, 128, (2, 16))
    before = module(x).logits
    fast_path.install_loss_forward(module, fast_path.loss_function(spec, "chunked"))
    assert torch.equal(module(x).logits, before) and list(module.state_dict()) == keys
    assert torch.allclose(module(x, loss_labels=x), spec.loss(module(x), x), rtol=TOL)


def test_config_fields_for_the_levers():
    from bigtrain.config.load import load_run_config
    run = load_run_config(None, ["train.compile=true", "train.loss_impl=chunked", "batch.micro_batch=auto",
                                 "batch.global_batch=64"])
    assert (run.train.compile, run.train.loss_impl, run.batch.micro_batch) == (True, "chunked", "auto")
    default = load_run_config(None, [])
    assert (default.train.compile, default.train.loss_impl) == ("auto", "auto")
    assert load_run_config(None, ["train.compile=deepcompile"]).train.compile == "deepcompile"
    with pytest.raises(ValueError, match="needs batch.global_batch|give batch.global_batch"):
        load_run_config(None, ["batch.micro_batch=auto"])
    with pytest.raises(ValueError, match="train.compile='fast'"):
        load_run_config(None, ["train.compile=fast"])


def test_bf16_configs_skip_deepspeeds_overflow_check_and_deepspeed_reads_the_key():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config

    from bigtrain.config.load import load_run_config
    from bigtrain.ds.generate import build_ds_config
    bf16 = build_ds_config(load_run_config(None, ["precision=bf16"]), 2)["bf16"]
    assert bf16 == {"enabled": True, "check_grad_overflow": False}
    assert DeepSpeedBF16Config(**bf16).check_grad_overflow is False
    assert build_ds_config(load_run_config(None, ["precision=fp32"]), 2)["bf16"] == {"enabled": False}
    assert "wall_clock_breakdown" not in build_ds_config(load_run_config(None, []), 2)


def test_vocabulary_padding_is_the_default_on_gpus_only():
    from bigtrain.models.registry import DataFacts, model_overrides
    facts = DataFacts(seq_len=1024, vocab_size=50257, num_classes=10)
    padded = model_overrides("gpt2", "small", facts, None, {}, "cuda")
    assert padded["vocab_multiple"] == 64
    assert "vocab_multiple" not in model_overrides("gpt2", "small", facts, None, {}, "cpu")
    assert "vocab_multiple" not in model_overrides("resnet", "18", facts, None, {}, "cuda")
    assert model_overrides("gpt2", "small", facts, None, {"vocab_multiple": 1}, "cuda")["vocab_multiple"] == 1
    assert models.build("gpt2", "small", **padded).vocab_size == 50304


# -- batch.micro_batch=auto ---------------------------------------------------------------------

@pytest.mark.parametrize("limit,upper", [(37, 64), (64, 64), (1, 16), (200, 48), (0, 8)])
def test_micro_batch_search_finds_the_largest_that_fits_a_fake_memory_limit(limit, upper):
    probed = []

    def fits(n):
        probed.append(n)
        return n <= limit

    search = autobatch.search_micro_batch(fits, upper)
    assert search.best == min(limit, upper)
    assert len(set(probed)) == len(probed) and max(probed) <= upper
    assert len(probed) <= 2 * math.ceil(math.log2(upper)) + 1  # doubling, then bisection
    assert largest_divisor_upto(48, 37) == 24 and largest_divisor_upto(7, 5) == 1


class _FakeAccelerator:
    """Device memory as the probe reads it: model states plus activations per sample; above `capacity` a
    step raises torch.OutOfMemoryError."""

    def __init__(self, states: int, per_sample: int, capacity: int):
        self.states, self.per_sample, self.capacity = states, per_sample, capacity
        self.peak, self.steps = 0, []

    def step(self, n: int) -> None:
        self.steps.append(n)
        need = self.states + n * self.per_sample
        if need > self.capacity:
            raise torch.OutOfMemoryError(f"out of memory: {need} bytes")
        self.peak = max(self.peak, need)

    def reset_peak_memory_stats(self):
        self.peak = 0

    def max_memory_allocated(self):
        return self.peak

    def memory_allocated(self):
        return self.states

    def empty_cache(self):
        pass

    def current_device_name(self):
        return "cpu"


def test_micro_batch_probe_keeps_the_global_batch_and_survives_out_of_memory(monkeypatch):
    import deepspeed.accelerator
    acc = _FakeAccelerator(states=1000, per_sample=100, capacity=5000)  # 40 samples fit the device
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: acc)
    built = []

    class Engine:
        def __init__(self):
            built.append(self)

        def train_step(self, batches):
            acc.step(next(batches)["n"])
            return torch.tensor(1.0)

    def batches_of(n):
        while True:
            yield {"n": n}

    budget = 3600  # 26 samples within the budget
    search = autobatch.probe_micro_batch(Engine, batches_of, per_rank=96, budget_bytes=budget)
    assert search.best == 26
    assert [n for n, _ in search.probes] == [1, 2, 4, 8, 16, 32, 24, 28, 26, 27]
    assert max(acc.steps) <= 40 and len(built) == 1  # predicted from the last fit: no real out-of-memory
    micro = largest_divisor_upto(96, search.best)
    assert (micro, 96 // micro) == (24, 4)  # micro-batch x accumulation keeps the rank's 96 samples
    # A real out-of-memory error (no prediction yet) is an answer: the engine is rebuilt for the next probe.
    acc.__init__(states=1000, per_sample=100, capacity=5000)
    built.clear()
    search = autobatch.probe_micro_batch(Engine, batches_of, per_rank=64, budget_bytes=10**9)
    assert search.best == 40 and len(built) >= 2


def test_the_summed_chunked_loss_is_the_mean_times_the_targets_with_its_gradients():
    """reduction="sum" (a sequence-parallel rank's share, bigtrain.objectives.causal_lm): the summed token losses,
    and gradients that are the mean's times the count."""
    torch.manual_seed(0)
    h, w = torch.randn(20, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    targets = torch.randint(0, 11, (20,))
    targets[::3] = -100
    count = int((targets != -100).sum())
    summed = linear_cross_entropy(h, w, targets, chunk_rows=7, reduction="sum")
    summed.backward()
    dh, dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    plain = torch.nn.functional.cross_entropy(h @ w.T, targets, ignore_index=-100, reduction="sum")
    plain.backward()
    assert float(summed) == pytest.approx(float(plain), rel=1e-5)
    assert torch.allclose(dh, h.grad, atol=1e-5) and torch.allclose(dw, w.grad, atol=1e-5)
    mean = linear_cross_entropy(h.detach(), w.detach(), targets, chunk_rows=7)
    assert float(summed) == pytest.approx(float(mean) * count, rel=1e-5)
    with pytest.raises(ValueError, match="mean or sum"):
        linear_cross_entropy(h, w, targets, reduction="none")
