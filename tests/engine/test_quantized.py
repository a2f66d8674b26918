"""engine/kernels/quantized.py: int4 / int8 weight-only linears, on dflash's int8-activation kernels or torch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_cli import speculative_generate
from dflash_cli.engine.kernels import quantized
from dflash_cli.engine.kernels.quantized import (
    GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    Projection,
    SharedInput,
    quantizable,
    quantize_linears,
    quantize_target,
    share_inputs,
)
from dflash_cli.engine.sampling import greedy_tokens
from dflash_cli.setup.sizes import module_weight_bytes, step_bytes
from helpers.drafters import FORMATS, random_drafter
from helpers.kernels import int8_activation_product, use_kernels
from helpers.tiny_models import hf_greedy, quantizable_tiny


@pytest.fixture(params=["native", "torch"])
def int4_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Int4Linear's two layouts: dflash's kernel (int8 activations), where this CPU runs it, and torch's."""
    use_kernels(request.param == "native", monkeypatch)
    return request.param


def test_int4_groups_round_trip_exactly_and_the_kernel_multiplies_by_them(int4_layout: str) -> None:
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (48, 128))
    scales = torch.rand(48, 128 // GROUP_SIZE) * 0.1 + 0.01
    mins = torch.randn(48, 128 // GROUP_SIZE) * 0.1
    layer = Int4Linear.from_groups(codes, scales, mins, torch.float32)
    if int4_layout == "native":  # (float16 scales and mins, as Q4_1 stores them)
        scales, mins = scales.half().float(), mins.half().float()
    expected = codes.float() * scales.repeat_interleave(GROUP_SIZE, 1) + mins.repeat_interleave(GROUP_SIZE, 1)
    torch.testing.assert_close(layer.dequantized(), expected, rtol=0, atol=1e-6)
    x = torch.randn(2, 3, 128)
    if int4_layout == "native":  # one bf16 rounding of the result
        torch.testing.assert_close(layer(x), int8_activation_product(x, expected), rtol=8e-3, atol=8e-3)
        assert not torch.allclose(layer(x), x @ expected.T, rtol=1e-4, atol=1e-4)  # (it did quantize the rows)
    else:
        torch.testing.assert_close(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_type", [Int4Linear, Int8Linear])
def test_the_int8_activation_kernels_give_a_row_the_same_bits_alone_in_a_block_and_on_any_threads(
    layer_type: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rows are quantized and summed each on its own, in one order: a verify block's row is that row decoded
    alone (what keeps speculative decoding lossless), with outputs not a multiple of 16 (the padded last block)."""
    use_kernels(True, monkeypatch)
    torch.manual_seed(4)
    outputs = 40 if layer_type is Int4Linear else 48  # (int8 keeps torch's layout where outputs would need padding)
    layer = layer_type.from_weight(torch.randn(outputs, 192), torch.bfloat16)
    assert layer.native
    x = torch.randn(13, 192, dtype=torch.bfloat16)
    block = layer(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(block, alone)
    assert block.shape == (13, outputs)
    torch.testing.assert_close(block.float(), int8_activation_product(x, layer.dequantized()), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_weights_stay_within_half_a_step_of_the_float_ones(kind: str) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(128, 32, bias=True)
    layer = (Int4Linear if kind == "int4" else Int8Linear).quantize(linear, torch.float32)
    error = (layer.dequantized() - linear.weight).abs()
    native_int4 = kind == "int4" and layer.native  # (float16 scales and mins: their rounding on top)
    if kind == "int4":
        groups = linear.weight.detach().reshape(32, -1, GROUP_SIZE)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(GROUP_SIZE, 1)
    else:
        step = (linear.weight.detach().abs().amax(1, keepdim=True) / 127).expand(-1, 128)
    assert (error <= step / 2 + (2e-4 if native_int4 else 1e-6)).all()
    x = torch.randn(5, 128)
    if layer.native:  # dflash's kernels: the rows quantized to int8 too
        expected = int8_activation_product(x, layer.dequantized()) + linear.bias
        torch.testing.assert_close(layer(x), expected, rtol=8e-3, atol=8e-3)
    else:
        torch.testing.assert_close(layer(x), x @ layer.dequantized().T + linear.bias, rtol=1e-5, atol=1e-5)
    assert not torch.equal(layer.dequantized(), linear.weight)  # it did quantize


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_weight_quantized_a_few_rows_at_a_time_is_the_weight_quantized_whole(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group (int4) and each scale (int8) lies within a row, so slicing the rows (which keeps a large head's
    float32 temporaries small) changes no code and no scale."""
    torch.manual_seed(3)
    weight, bias = torch.randn(80, 192, dtype=torch.bfloat16), torch.randn(80, dtype=torch.bfloat16)
    layer = Int4Linear if kind == "int4" else Int8Linear
    whole = layer.from_weight(weight, torch.bfloat16, bias)
    monkeypatch.setattr(quantized, "QUANTIZE_SLICE_ELEMENTS", 3 * 192)  # 27 slices, the last of 2 rows
    sliced = layer.from_weight(weight, torch.bfloat16, bias)
    assert whole.state_dict().keys() == sliced.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, sliced.state_dict()[name]), name


def test_only_cpu_linears_of_packable_shapes_are_quantized() -> None:
    assert quantizable(nn.Linear(64, 16), "int4") and quantizable(nn.Linear(64, 24), "int8")
    assert not quantizable(nn.Linear(64, 24), "int4")  # outputs not a multiple of 16
    assert not quantizable(nn.Linear(32, 16), "int4")  # inputs not whole groups of 64
    assert not quantizable(nn.Embedding(16, 64), "int8")
    with pytest.raises(ValueError, match="unknown weight-only quantization"):
        quantize_linears(nn.Linear(64, 16), "int3", torch.float32)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_tied_head_is_quantized_as_its_own_int8_copy_and_the_bytes_shrink(kind: str) -> None:
    model = quantizable_tiny(2, tied=True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    before = module_weight_bytes(model)
    assert quantize_target(model, kind, torch.float32) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # the embedding keeps its float table
    layer = Int4Linear if kind == "int4" else Int8Linear
    assert isinstance(model.model.layers[1].mlp.down_proj, layer)
    assert isinstance(model.get_output_embeddings(), Int8Linear)  # 8 bits for the head, as GGUF's 4-bit files do
    after = module_weight_bytes(model)
    assert 0 < after < before
    # a decode step reads the quantized head and one embedding row (no longer the same tensor)
    assert step_bytes(model, 0).weights == after - embedding.numel() * 4 + embedding.shape[1] * 4


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_speculative_greedy_on_a_quantized_target_equals_its_own_greedy(kind: str, fmt: str) -> None:
    """Lossless against the quantized target itself (float32 activations: exact comparisons)."""
    target = quantizable_tiny(3)
    quantize_target(target, kind, torch.float32)
    for seed, prompt in enumerate(([3, 14, 15, 92, 65], [1, 2, 3], [7] * 12)):
        drafter = random_drafter(target, seed=seed, num_layers=1, block_size=4, fmt=fmt)
        result = speculative_generate(target, drafter, prompt, 24)
        assert result.token_ids == hf_greedy(target, prompt, 24)


def test_a_bf16_quantized_target_decodes_with_the_drafter() -> None:
    """The dtype the planner runs them in: the drafter reads the quantized head in the embedding's dtype."""
    target = quantizable_tiny(4).to(torch.bfloat16)
    quantize_target(target, "int4", torch.bfloat16)
    drafter = random_drafter(target, seed=0, num_layers=1, block_size=4, dtype=torch.bfloat16)
    result = speculative_generate(target, drafter, [3, 14, 15], 16)
    assert len(result.token_ids) == 16 and all(0 <= t < 128 for t in result.token_ids)


def test_int4_of_a_dequantized_q4_1_gguf_tensor_is_that_q4_1_tensor() -> None:
    """GGUF's Q4_1 stores each group of 32 as min + q * (max - min) / 15, so its codes span 0..15 and min-max
    int4 over the dequantized weights (what the demo's converted checkpoint holds) finds the same groups again."""
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(5)
    weight = (torch.randn(48, 256) * 0.05).numpy()
    kind = gguf.GGMLQuantizationType.Q4_1
    dequantized = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight, kind), kind)).float()
    linear = nn.Linear(256, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(dequantized)
    assert not torch.equal(dequantized, torch.from_numpy(weight))  # Q4_1 did round
    torch.testing.assert_close(Int4Linear.quantize(linear, torch.float32).dequantized(), dequantized, rtol=0, atol=2e-7)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_projections_of_one_input_as_one_product_give_the_same_bits(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """share_inputs: each layer's q, k, v and gate, up as one product of dflash's kernels, one call each instead of
    five: the logits of a prompt's forward and of one-token steps are the separate products' bit for bit (bf16, as
    the planner runs them), and the greedy continuation with a drafter is the target's own."""
    use_kernels(True, monkeypatch)
    target = quantizable_tiny(5).to(torch.bfloat16)
    quantize_linears(target, kind, torch.bfloat16)  # (every linear, so the MLP's are of one kind)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        before = target(prompt).logits
        calls = []
        op = torch.ops.dflash.int4_linear if kind == "int4" else torch.ops.dflash.int8_linear
        counted = lambda *args: calls.append(1) or op(*args)  # noqa: E731
        layers = len(target.model.layers)
        assert share_inputs(target) == 2 * layers
        assert all(
            isinstance(getattr(layer.self_attn, name), Projection) for layer in target.model.layers for name in "qkv"
            for name in (f"{name}_proj",)
        )  # fmt: skip
        monkeypatch.setattr(torch.ops.dflash, "int4_linear" if kind == "int4" else "int8_linear", counted)
        after = target(prompt).logits
        assert len(calls) == 4 * layers + 1  # qkv, o, gate+up, down; the head
    assert torch.equal(before, after)
    monkeypatch.undo()
    use_kernels(True, monkeypatch)
    assert speculative_generate(target, random_drafter(target, seed=1, num_layers=1, block_size=4,
                                                       dtype=torch.bfloat16), [3, 14, 15], 16).token_ids == hf_greedy(
        target, [3, 14, 15], 16
    )  # fmt: skip


def test_a_shared_input_computes_again_for_another_input() -> None:
    """A projection called with another tensor, or twice with the same one, gets that input's product: the shared
    product is reused only by the other projections of the input it was made for."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, n, bias=False) for n in (32, 16)]
    fused = SharedInput(_ConcatenatedLinear(layers), [32, 16])
    first, second = Projection(fused, 0, 64, 32), Projection(fused, 1, 64, 16)
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    assert torch.equal(first(x), layers[0](x)) and torch.equal(first(y), layers[0](y))
    assert torch.equal(second(x), layers[1](x)) and torch.equal(second(x), layers[1](x))
    assert fused._input is x and torch.equal(first(x), layers[0](x))
    assert fused._input is None  # (every part taken: nothing held)


class _ConcatenatedLinear(nn.Module):
    def __init__(self, layers: list[nn.Linear]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


@pytest.mark.parametrize("scales", ["per group (Q8_0)", "per channel"])
def test_an_int8_layers_rows_give_exactly_its_outputs_for_them(int4_layout: str, scales: str) -> None:
    """Int8Linear.rows: a drafter's draft vocabulary takes its rows of an int8 head (bias included), in either layout,
    including the padded last block of 16."""
    torch.manual_seed(6)
    if scales == "per channel":
        layer = Int8Linear.from_weight(torch.randn(80, 64), torch.float32, bias=torch.randn(80))
    else:
        codes, group_scales = torch.randint(-127, 128, (80, 64)), torch.rand(80, 64 // GROUP_SIZE) * 0.02
        layer = Int8Linear.from_groups(codes, group_scales, torch.float32, bias=torch.randn(80))
    index = torch.tensor([0, 3, 17, 18, 40, 63, 79])
    rows = layer.rows(index)
    assert rows.native == layer.native and rows.out_features == len(index)
    x = torch.randn(5, 64)
    assert torch.equal(rows(x), layer(x)[:, index])
    torch.testing.assert_close(rows.dequantized(), layer.dequantized()[index], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_draft_vocabulary_over_a_quantized_head_proposes_what_its_masked_head_would(kind: str) -> None:
    """The drafter takes its vocabulary's rows of an int8 head (the demo's): the logits are the whole head's, masked
    outside the vocabulary, and the output stays the target's."""
    import dataclasses

    from dflash_cli.engine.drafter import make_drafter

    target = quantizable_tiny(3)
    quantize_target(target, kind, torch.float32)
    head = target.get_output_embeddings()
    assert isinstance(head, Int8Linear)
    plain = random_drafter(target, seed=1, num_layers=1, block_size=4)
    vocab = torch.arange(0, 128, 3)
    drafter = make_drafter(dataclasses.replace(plain.config, draft_vocab_size=len(vocab)), target)
    drafter.load_state_dict(plain.state_dict())
    drafter.use_vocabulary(vocab)
    hidden = torch.randn(2, 3, target.config.hidden_size)
    with torch.no_grad():
        whole = plain.logits(hidden)
        masked = torch.full_like(whole, float("-inf"))
        masked[..., vocab] = whole[..., vocab]
        assert torch.equal(drafter.logits(hidden), masked)
        assert torch.equal(drafter.select(hidden, hidden[:, 0, 0].long()), greedy_tokens(masked))
    # (its rows alone, not the masked head)
    assert isinstance(drafter._head_rows(head, hidden.device, hidden.dtype), Int8Linear)
    prompt = [3, 14, 15, 92, 65]
    assert speculative_generate(target, drafter, prompt, 24).token_ids == hf_greedy(target, prompt, 24)
