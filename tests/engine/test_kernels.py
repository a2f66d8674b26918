"""engine/kernels.py: the few-row products of decoding on a CPU (`W @ x.T` for 2-9 rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_cli import speculative_generate
from dflash_cli.engine.kernels import SMALL_ROWS, SmallRowLinear, use_small_row_products
from helpers.drafters import random_drafter
from helpers.tiny_models import hf_greedy, sharp_tiny


class _Ops(TorchDispatchMode):
    """The aten ops a block of code runs, with their argument shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
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
    assert use_small_row_products(layer) == 1 and type(layer) is SmallRowLinear
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


def test_only_plain_float32_cpu_linears_switch() -> None:
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Embedding(5, 4))
    assert use_small_row_products(model) == 1
    assert [type(m).__name__ for m in model] == ["SmallRowLinear", "Custom", "Linear", "Embedding"]
    assert use_small_row_products(model) == 0  # idempotent


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

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:  # noqa: ARG001
        graphs.append(gm)
        return gm

    layer = nn.Linear(48, 80)
    use_small_row_products(layer)
    x = torch.randn(1, rows, 48)
    out = torch.compile(layer, backend=record, fullgraph=True)(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    calls = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert F.linear in calls and torch.mm not in calls, calls
    torch._dynamo.reset()


def test_a_dynamic_graph_is_not_guarded_on_its_row_count() -> None:
    """The engine's CPU graphs take any block width and any number of new drafter rows in one graph (dynamic
    shapes): the row-count rule must not become a guard that recompiles (minutes on a CPU) when a width crosses
    the small-row range."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    layer = nn.Linear(48, 80)
    use_small_row_products(layer)
    step = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for rows in (4, SMALL_ROWS + 3, 2, SMALL_ROWS):
        x = torch.randn(1, rows, 48)
        torch.testing.assert_close(step(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    torch._dynamo.reset()
