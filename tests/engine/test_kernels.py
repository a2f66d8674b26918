"""engine/kernels/layers.py: the few-row products of decoding on a CPU (float32: `W @ x.T` for 2-9 rows; bf16: dflash's
kernel, or MKL with one row as two)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_cli import speculative_generate
from dflash_cli.engine.kernels.layers import SMALL_ROWS, SmallRowLinear, use_cpu_products
from helpers.drafters import random_drafter
from helpers.kernels import use_kernels
from helpers.tiny_models import hf_greedy, sharp_tiny


class _Ops(TorchDispatchMode):
    """The aten ops a block of code runs, with their argument shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func.overloadpacket), [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, SMALL_ROWS, SMALL_ROWS + 1, 17])
def test_small_row_linear_computes_the_same_product(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(48, 80, bias=bias)
    expected_state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(1, rows, 48)
    expected = F.linear(x, layer.weight, layer.bias)
    assert use_cpu_products(layer) == 1 and type(layer) is SmallRowLinear
    with _Ops() as seen:
        out = layer(x)
    assert out.shape == (1, rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # 2..SMALL_ROWS rows: the weight is the left operand of a plain product; otherwise F.linear's own call
    weight_first = [shapes for op, shapes in seen.ops if op == "aten.mm" and shapes[0] == (80, 48)]
    assert bool(weight_first) == (1 < rows <= SMALL_ROWS)
    if rows == 1 or rows > SMALL_ROWS:
        assert torch.equal(out, expected)
    assert layer.state_dict().keys() == expected_state.keys()
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in expected_state.items())


def test_only_plain_float32_and_bf16_cpu_linears_switch() -> None:
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(
        nn.Linear(4, 4),
        Custom(4, 4),
        nn.Linear(4, 4).to(torch.bfloat16),
        nn.Linear(4, 4).to(torch.float16),
        nn.Embedding(5, 4),
    )
    assert use_cpu_products(model) == 2
    assert [type(m).__name__ for m in model] == ["SmallRowLinear", "Custom", "Bf16Linear", "Linear", "Embedding"]
    assert use_cpu_products(model) == 0  # idempotent


@pytest.fixture(params=["dflash", "mkl"])
def bf16_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel a bf16 product may run on: dflash's (where this machine has it) and MKL's."""
    use_kernels(request.param == "dflash", monkeypatch)
    return request.param


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 48), (48,), (1, 3, 48), (2, 5, 48)])
def test_bf16_linear_runs_its_kernel(shape: tuple[int, ...], bias: bool, bf16_kernel: str) -> None:
    """dflash's kernel takes every bf16 product, one row as it is; on MKL one row runs as a two-row product (MKL's
    one-row bf16 kernel rounds otherwise), more rows as F.linear."""
    torch.manual_seed(len(shape))
    layer = nn.Linear(48, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    use_cpu_products(layer)
    with _Ops() as seen, torch.no_grad():  # as the decode loop runs (with gradients: torch's, tested below)
        out = layer(x)
    assert out.shape == (*shape[:-1], 80)
    rows = x.numel() // 48
    products = [shapes for op, shapes in seen.ops if op in ("aten.mm", "aten.addmm")]  # [rows, 48] @ W.T
    if bf16_kernel == "dflash":
        assert [shapes for op, shapes in seen.ops if op.startswith("dflash.")] == [[(rows, 48), (80, 48)]], seen.ops
        assert not products
        reference = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
    else:
        assert [shapes[-2] for shapes in products] == [(max(rows, 2), 48)], seen.ops
        reference = F.linear(x.reshape(-1, 48).expand(max(rows, 2), 48), layer.weight, layer.bias)[:rows]
        assert torch.equal(out.reshape(rows, 80), reference)


def test_a_switched_bf16_linear_carries_gradients(bf16_kernel: str) -> None:
    """Training reads the target's output head after the decode loop switched it (measuring tau mid-run): a product
    a gradient flows through gets torch's gradient, never dflash's kernel, which has no backward."""
    torch.manual_seed(0)
    reference = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    layer = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    layer.load_state_dict(reference.state_dict())
    use_cpu_products(layer)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    grads = []
    for module in (reference, layer):
        inputs = x.clone().requires_grad_()
        module(inputs).float().square().sum().backward()
        grads.append(inputs.grad)
    torch.testing.assert_close(grads[1], grads[0])
    with torch.inference_mode():  # decoding still takes the switched product
        assert torch.equal(layer(x), layer(x.clone()))


def test_bf16_rows_agree_whatever_the_row_count(bf16_kernel: str) -> None:
    """The rule the engine's batch invariance rests on, checked on this machine for each kernel: a bf16 row's output
    is the same bits alone, in a block, or in a prefill-sized product (engine.kernels.layers). MKL's one-row kernel
    rounds otherwise for some weight addresses: the weight sits at several offsets into a buffer."""
    for seed in (0, 1):
        torch.manual_seed(seed)
        flat = torch.randn(576 * 1536 + 64).to(torch.bfloat16)
        x = (torch.randn(300, 1536) * torch.rand(300, 1536).pow(4)).to(torch.bfloat16)  # an MLP's skewed activations
        for offset in range(0, 64, 8):
            layer = nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
            layer.weight = nn.Parameter(flat[offset : offset + 576 * 1536].view(576, 1536), requires_grad=False)
            use_cpu_products(layer)
            whole = layer(x)
            for rows in (1, 2, 3, 8, 17, 64, 200):
                assert torch.equal(layer(x[:rows]), whole[:rows]), (seed, offset, rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_greedy_on_switched_models_is_the_targets_greedy(seed: int) -> None:
    """Greedy with the switched kernels (the engine switches target and drafter itself) is transformers' greedy on
    the same switched model, and the baseline's output; verify blocks of 2-8 rows run `W @ x.T`."""
    target = sharp_tiny("qwen3", seed)
    drafter = random_drafter(target, seed=seed, block_size=4)
    prompt = [(7 * seed + 3 * i) % 90 + 1 for i in range(11)]
    baseline = speculative_generate(target, None, prompt, 24)
    assert all(type(m) is not nn.Linear for m in target.modules())  # the engine switched it
    with _Ops() as seen:
        result = speculative_generate(target, drafter, prompt, 24, block_size=4)
    assert result.token_ids == baseline.token_ids == hf_greedy(target, prompt, 24)
    hidden = target.config.hidden_size
    assert any(op == "aten.mm" and shapes[0][1] == hidden and shapes[1] == (hidden, 4) for op, shapes in seen.ops)


@pytest.mark.parametrize("rows", [1, 4, SMALL_ROWS + 3])
def test_a_compiled_step_sees_every_product_as_a_linear(rows: int) -> None:
    """Compiled CPU steps freeze the weights and pack them for inductor's GEMM kernels, whose pattern is the
    linear: inside a traced graph `SmallRowLinear` must ask its product as F.linear, at every row count."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    layer = nn.Linear(48, 80)
    use_cpu_products(layer)
    x = torch.randn(1, rows, 48)
    out = torch.compile(layer, backend=record, fullgraph=True)(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    calls = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert F.linear in calls and torch.mm not in calls, calls
    torch._dynamo.reset()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_compiled_step_takes_a_bf16_layer_whole(rows: int, bf16_kernel: str) -> None:
    """torch.compile (the draft step, --compile on) traces a bf16 layer in one graph on either kernel: the choice
    is a plain attribute set when the layer was switched, not a build dynamo would trace into."""
    torch._dynamo.reset()
    layer = nn.Linear(48, 80).to(torch.bfloat16)
    use_cpu_products(layer)
    assert layer.dflash_kernel == (bf16_kernel == "dflash")
    x = torch.randn(1, rows, 48).to(torch.bfloat16)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
    torch._dynamo.reset()


def test_a_dynamic_graph_is_not_guarded_on_its_row_count() -> None:
    """The engine's CPU graphs take any block width and any number of new drafter rows in one graph (dynamic
    shapes): the row-count rule must not become a guard that recompiles (minutes on a CPU) when a width crosses
    the small-row range."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    layer = nn.Linear(48, 80)
    use_cpu_products(layer)
    step = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for rows in (4, SMALL_ROWS + 3, 2, SMALL_ROWS):
        x = torch.randn(1, rows, 48)
        torch.testing.assert_close(step(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    torch._dynamo.reset()
