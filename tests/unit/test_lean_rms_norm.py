"""The lean RMSNorm of ALST's levers (bigtrain.parallel.rms_norm): transformers' Llama RMSNorm's output and
gradients, found by what a norm computes, on this model's instances only, and less memory in backward."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from bigtrain.estimate.live_bytes import LiveBytes
from bigtrain.models import build
from bigtrain.parallel.rms_norm import apply_lean_rms_norm, is_lean_compatible, lean_rms_norm
from bigtrain.parallel.tiling import apply_tiled_mlp, apply_tiles


def norm_and_grads(norm: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, lean_tile: int = 0) -> tuple:
    x = x.clone().requires_grad_(True)
    norm.weight.grad = None
    y = lean_rms_norm(x, norm.weight, norm.variance_epsilon, lean_tile) if lean_tile else norm(x)
    y.backward(dy)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("tokens,tile", [(37, 8), (37, 64), (1, 4), (255, 256)])
@pytest.mark.parametrize("dtype,weight_dtype,tolerance", [(torch.float32, torch.float32, 1e-6),
                                                          (torch.bfloat16, torch.bfloat16, 1e-2),
                                                          (torch.bfloat16, torch.float32, 1e-2)])
def test_the_lean_norm_gives_llamas_output_and_gradients(tokens, tile, dtype, weight_dtype, tolerance):
    """Forward equal; grad input and grad weight within 1e-6 in fp32 (relative to the largest value) and within
    bf16's rounding in bf16 (bf16 hidden states with a bf16 or an fp32 weight), on odd token counts and tiles that
    do and do not divide them."""
    generator = torch.Generator().manual_seed(tokens)
    norm = LlamaRMSNorm(48, eps=1e-5)
    norm.weight.data = torch.rand(48, generator=generator) + 0.5
    norm = norm.to(weight_dtype)
    x = (torch.randn(2, tokens, 48, generator=generator) * 3).to(dtype)
    dy = torch.randn(2, tokens, 48, generator=generator).to(torch.result_type(norm.weight, x))
    plain, lean = norm_and_grads(norm, x, dy), norm_and_grads(norm, x, dy, lean_tile=tile)
    assert torch.equal(plain[0], lean[0])
    for a, b in zip(plain, lean):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.float() - b.float()).abs().max() <= tolerance * a.float().abs().max(), (a, b)


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    norm = LlamaRMSNorm(16).requires_grad_(False)
    x = torch.randn(5, 16, requires_grad=True)
    lean_rms_norm(x, norm.weight, norm.variance_epsilon, 2).sum().backward()
    assert norm.weight.grad is None and x.grad is not None and x.grad.abs().sum() > 0


def test_norms_are_matched_by_what_they_compute():
    """Llama's RMSNorm (and a ZeRO-3 partitioned one, its weight empty, `ds_shape` kept) goes lean; Gemma's
    (1 + weight, `eps`), T5's (x^ not rounded to the input's dtype), torch's LayerNorm and RMSNorm do not."""
    assert is_lean_compatible(LlamaRMSNorm(32)) and is_lean_compatible(LlamaRMSNorm(32).to(torch.bfloat16))
    partitioned = LlamaRMSNorm(32)
    partitioned.weight.data = torch.empty(0)
    partitioned.weight.ds_shape = torch.Size([32])
    assert is_lean_compatible(partitioned)
    for other in (GemmaRMSNorm(32), T5LayerNorm(32), torch.nn.LayerNorm(32), torch.nn.RMSNorm(32)):
        assert not is_lean_compatible(other), type(other).__name__
    model = torch.nn.Sequential(LlamaRMSNorm(8), T5LayerNorm(8), GemmaRMSNorm(8))
    assert apply_lean_rms_norm(model, 4) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])


class ShiftedRMSNorm(LlamaRMSNorm):
    """Llama's norm, or Gemma's `1 + weight` where the instance says so: the verdict depends on an attribute."""

    def __init__(self, hidden_size: int, shifted: bool) -> None:
        super().__init__(hidden_size)
        self.shifted = shifted

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden_states)
        return out + out / self.weight if self.shifted else out


def test_a_models_norms_are_probed_once_per_class_shape_and_attributes(monkeypatch):
    """A 128K-context memory estimate applies the levers to 9 models of 65 norms: one probe per kind of norm, not
    per norm. Norms alike share a verdict; a differing shape, eps or attribute (here one that changes the forward)
    gets its own probe and its own verdict."""
    from bigtrain.parallel import rms_norm
    probed = []
    monkeypatch.setattr(rms_norm, "is_lean_compatible",
                        lambda m, _probe=rms_norm.is_lean_compatible: probed.append(m) or _probe(m))
    norms = [LlamaRMSNorm(8) for _ in range(5)] + [LlamaRMSNorm(16), LlamaRMSNorm(8, eps=1e-5)]
    norms += [ShiftedRMSNorm(8, shifted=False), ShiftedRMSNorm(8, shifted=True), ShiftedRMSNorm(8, shifted=False)]
    model = torch.nn.Sequential(*norms)
    assert apply_lean_rms_norm(model, 4) == len(norms) - 1
    assert "forward" not in vars(model[8]) and all("forward" in vars(m) for i, m in enumerate(model) if i != 8)
    assert [i for i, m in enumerate(model) if any(m is p for p in probed)] == [0, 5, 6, 7, 8]


def tiny_llama_step(model: torch.nn.Module, spec, ids: torch.Tensor) -> float:
    model.train()
    loss = spec.loss(model(ids), ids)
    loss.backward()
    return loss.item()


def test_a_tiny_llama_with_the_levers_gives_the_plain_loss_and_gradients():
    """Tiled MLP + lean RMSNorms (apply_tiles, as the engine applies them) against the plain model: the same loss
    and every gradient within 1e-5; the class is never patched, so a second model in the process (a reference, a
    teacher) runs its own norm, and eval runs the plain forward."""
    spec = build("llama", "tiny", vocab_size=128, seq_len=67)
    plain = spec.build(seed=0)
    levered = copy.deepcopy(plain)
    mlps, norms = apply_tiles(levered, 16)
    assert mlps == spec.config.num_hidden_layers and norms == 2 * mlps + 1  # two per block and the final norm
    ids = torch.randint(0, 128, (2, 67), generator=torch.Generator().manual_seed(0))
    assert tiny_llama_step(plain, spec, ids) == pytest.approx(tiny_llama_step(levered, spec, ids), rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), levered.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name
    assert not any("forward" in vars(m) for m in plain.modules() if isinstance(m, LlamaRMSNorm))
    with torch.no_grad():
        assert torch.equal(plain.eval()(ids).logits, levered.eval()(ids).logits)


def backward_peak(model: torch.nn.Module, spec, ids: torch.Tensor) -> int:
    with LiveBytes() as watch:
        spec.loss(model(ids), ids).backward()
    return watch.snapshot().peak


def test_the_lean_norm_holds_less_at_the_backward_peak():
    """One norm over 4,096 tokens x 256: the plain module keeps x * rstd and makes 4-5 fp32 temporaries the size
    of its input in backward; the lean one keeps nothing of its own and makes only the input's gradient (plus a
    tile), so its forward-and-backward peak is under half the plain one's. A tiny Llama's step with the MLP tiled
    peaks lower with the lean norms than without them."""
    norm = LlamaRMSNorm(256)
    x = torch.randn(4096, 256, requires_grad=True)
    peaks = []
    for tile in (0, 256):
        with LiveBytes() as watch:
            y = lean_rms_norm(x, norm.weight, norm.variance_epsilon, tile) if tile else norm(x)
            y.backward(torch.ones_like(y))
        peaks.append(watch.snapshot().peak)
    assert peaks[1] < 0.5 * peaks[0], peaks
    spec = build("llama", "tiny", vocab_size=128, seq_len=512, n_positions=512)
    tiled_only, levered = spec.build(seed=0).train(), spec.build(seed=0).train()
    apply_tiled_mlp(tiled_only, 64)
    apply_tiles(levered, 64)
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(0))
    hidden_bytes = 512 * spec.config.hidden_size * 4
    assert backward_peak(levered, spec, ids) <= backward_peak(tiled_only, spec, ids) - hidden_bytes
