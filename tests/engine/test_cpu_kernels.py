"""engine/kernels/native.py: dflash's bf16 CPU kernels, built here (the C++ compiler), against float references, and
the rule the engine rests on: a row's bits never depend on the rows around it, the row count or the threads."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

from dflash_cli.engine.kernels import native


@pytest.fixture(autouse=True)
def kernels(request: pytest.FixtureRequest) -> None:
    """The ops' tests need the kernels built and loaded here (not at collection: a build takes seconds)."""
    if "needs_no_kernels" not in request.keywords and not native.available():
        pytest.skip(f"dflash's CPU kernels: {native.unavailable()}")


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> int:
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


# outputs: a partial last 16-output task, and fewer than one; inputs: below, at and past whole chunks of 64
@pytest.mark.parametrize(("out_features", "in_features"), [(80, 64), (37, 100), (16, 576), (5, 7), (192, 1536)])
def test_bf16_linear_is_the_product(out_features: int, in_features: int, threads: int) -> None:
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    x = torch.randn(9, in_features).to(torch.bfloat16)
    out = torch.ops.dflash.bf16_linear(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (9, out_features)
    reference = x.double() @ weight.double().T  # exact products; the kernel rounds its float32 sum once to bf16
    tolerance = 1e-5 * (x.double().abs() @ weight.double().abs().T) + 2**-8 * reference.abs()
    assert ((out.double() - reference).abs() <= tolerance + 1e-30).all()


def test_bf16_linear_rows_keep_their_bits(threads: int) -> None:
    """Each row alone, in every block of 1..17 rows, at any offset inside it, on 1 or 2 threads: the same bits."""
    torch.manual_seed(threads)
    weight = torch.randn(205, 300).to(torch.bfloat16)  # (a last task of 13 outputs: an odd one past the pairs)
    x = (torch.randn(17, 300) * torch.rand(17, 300).pow(4)).to(torch.bfloat16)  # skewed, as an MLP's activations
    alone = torch.cat([torch.ops.dflash.bf16_linear(x[i : i + 1], weight) for i in range(17)])
    for start in range(3):
        for rows in range(1, 18 - start):
            block = torch.ops.dflash.bf16_linear(x[start : start + rows], weight)
            assert torch.equal(block, alone[start : start + rows]), (start, rows)


def test_bf16_linear_takes_views_and_empty_blocks() -> None:
    weight = torch.randn(64, 128).to(torch.bfloat16)
    x = torch.randn(3, 256).to(torch.bfloat16)[:, ::2]  # not contiguous
    torch.testing.assert_close(
        torch.ops.dflash.bf16_linear(x, weight.T.contiguous().T), torch.ops.dflash.bf16_linear(x.contiguous(), weight)
    )
    assert torch.ops.dflash.bf16_linear(x[:0], weight).shape == (0, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.dflash.bf16_linear(x.float(), weight)


def _eager_attention(
    rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scaling: float
):
    """engine.target.standard's eager attention: bf16 products, float32 softmax, keys after a query masked."""
    copies = rows.shape[2] // positions.shape[1]
    end = int(positions.max()) + 1
    scores = torch.matmul(rows, keys[:, :, :end].transpose(2, 3)) * scaling
    future = (torch.arange(end)[None, None, :] > positions[:, :, None]).repeat(1, copies, 1)[:, None]
    scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
    return torch.matmul(weights, values[:, :, :end])


@pytest.mark.parametrize(("kv_heads", "fold", "head_dim"), [(3, 3, 64), (2, 1, 32), (1, 4, 128)])
def test_attention_is_the_eager_attention_and_rows_keep_their_bits(
    kv_heads: int, fold: int, head_dim: int, threads: int
) -> None:
    """Each query's output: the eager graph's (within a bf16 rounding), and the same bits alone (a one-token step
    at its position, a row alone) as inside a block of its row and a batch of rows of other lengths."""
    torch.manual_seed(kv_heads * fold)
    keys = torch.randn(3, kv_heads, 300, head_dim).to(torch.bfloat16)
    values = torch.randn(3, kv_heads, 300, head_dim).to(torch.bfloat16)
    scaling = head_dim**-0.5
    for q, ends in [(1, (1, 57, 300)), (4, (200, 4, 31)), (16, (300, 16, 100))]:
        positions = torch.stack([torch.arange(end - q, end) for end in ends])
        query = torch.randn(3, kv_heads, fold, q, head_dim).to(torch.bfloat16)
        rows = query.reshape(3, kv_heads, fold * q, head_dim)
        out = torch.ops.dflash.attention(rows, keys, values, positions, scaling)
        torch.testing.assert_close(out, _eager_attention(rows, keys, values, positions, scaling), rtol=2e-2, atol=2e-2)
        blocks = out.reshape(3, kv_heads, fold, q, head_dim)
        for b in range(3):
            row = torch.ops.dflash.attention(
                rows[b : b + 1], keys[b : b + 1], values[b : b + 1], positions[b : b + 1], scaling
            )
            assert torch.equal(row, out[b : b + 1]), (q, b)
            for i in range(q):  # query i alone, as a one-token step at its own position
                lone = query[b : b + 1, :, :, i].reshape(1, kv_heads, fold, head_dim)
                alone = torch.ops.dflash.attention(
                    lone, keys[b : b + 1], values[b : b + 1], positions[b : b + 1, i : i + 1], scaling
                )
                assert torch.equal(alone, blocks[b : b + 1, :, :, i]), (q, b, i)


def test_attention_refuses_what_it_cannot_read() -> None:
    keys = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    rows = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="past the buffer"):
        torch.ops.dflash.attention(rows, keys, keys, torch.tensor([[8]]), 0.1)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.dflash.attention(rows, keys, keys, torch.tensor([[1], [2]]), 0.1)  # positions for two rows
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.dflash.attention(rows.float(), keys, keys, torch.tensor([[3]]), 0.1)


@pytest.mark.slow
@pytest.mark.needs_no_kernels
def test_the_environment_switches_them_off() -> None:
    """`DFLASH_CPU_KERNELS=0`: the process keeps torch's kernels and says why."""
    code = "from dflash_cli.engine.kernels import native; print(native.available(), native.unavailable())"
    env = {**os.environ, native.ENVIRONMENT: "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == ["False", f"{native.ENVIRONMENT}=0"]


@pytest.mark.slow
@pytest.mark.needs_no_kernels
def test_a_failed_build_keeps_torchs_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails: a warning naming the failure, torch's kernels, nothing half-written in the cache."""
    code = (
        "import warnings; from pathlib import Path; from dflash_cli.engine.compiled import jit; from dflash_cli.engine.kernels import native\n"
        f"jit.compile_cache_dir = lambda: Path({str(tmp_path)!r})\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    print(native.available())\n"
        "print(seen[0].message)\n"
        "print(sorted(p.name for p in Path(%r).rglob('*') if p.is_file()))\n" % str(tmp_path)
    )
    env = {**os.environ, "CXX": "false"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = done.stdout.splitlines()
    assert lines[0] == "False"
    assert "could not build them" in lines[1] and "torch's kernels run instead" in lines[1]
    assert [name for name in ast.literal_eval(lines[2]) if not name.endswith(".failed")] == []  # no library at all
    # the next start reads the failure without building or warning again, and says it
    again = (
        "import warnings; from pathlib import Path; from dflash_cli.engine.compiled import jit; from dflash_cli.engine.kernels import native\n"
        f"jit.compile_cache_dir = lambda: Path({str(tmp_path)!r})\n"
        "warnings.simplefilter('error')\n"
        "print(native.pending_build(), native.available()); print(native.unavailable())\n"
    )
    done = subprocess.run([sys.executable, "-c", again], capture_output=True, text=True, env=env, check=True)
    first, reason = done.stdout.splitlines()
    assert first == "False False" and "could not build them" in reason and "another compiler" in reason


@pytest.mark.slow
def test_a_build_deletes_the_libraries_of_earlier_sources(tmp_path) -> None:
    """One library per machine: a build removes the libraries (and failure markers) other sources, torch versions,
    flags or names left in the cache."""
    stale = [
        tmp_path / "kernels" / f"dflash_cpu_kernels-{'0' * 16}.so",
        tmp_path / "kernels" / f"dflash_cpu_kernels-{'1' * 16}.failed",
        tmp_path / "kernels" / f"dflash_cpu_linear-{'2' * 16}.so",  # (the kernels' name before they took attention)
    ]
    stale[0].parent.mkdir(parents=True)
    for path in stale:
        path.write_text("from an earlier dflash")
    code = (
        "from pathlib import Path; from dflash_cli.engine.compiled import jit; from dflash_cli.engine.kernels import native\n"
        f"jit.compile_cache_dir = lambda: Path({str(tmp_path)!r})\n"
        "print(native.available(), native.library_path().name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    built, name = done.stdout.split()
    assert built == "True" and sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [name]


# rows: past and short of whole 16-lane chunks, the demo's vocabulary; ties, NaNs, infinities and signed zeros
@pytest.mark.parametrize("width", [1, 15, 16, 33, 49152])
def test_argmax_is_torchs_on_the_widened_logits(width: int) -> None:
    """Greedy's token (engine.sampling.greedy_tokens on bf16 CPU logits): the index torch.argmax gives over the same
    values in float32, the first of equal maxima, the first NaN where there is one."""
    from dflash_cli.engine.sampling import greedy_tokens

    torch.manual_seed(width)
    logits = (torch.randn(7, width) * 4).to(torch.bfloat16)
    logits[1] = logits[1, 0]  # every value tied: index 0
    logits[2, width // 2 :] = logits[2].max() + 1  # a tie of the maximum from the middle on: its first index
    logits[3] = float("-inf")
    logits[4, width - 1] = float("nan")
    if width > 1:
        logits[5, 0], logits[5, 1:] = -0.0, 0.0  # -0 equals +0: index 0
        logits[4, width // 3] = float("nan")  # two NaNs: the first
        logits[6, -1] = float("inf")
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(torch.ops.dflash.argmax(logits), expected)
    assert torch.equal(greedy_tokens(logits.view(7, 1, width)), expected[:, None])  # any leading shape


_TIER_PRODUCTS = """
import sys, torch
from pathlib import Path
from dflash_cli.engine.compiled import jit
from dflash_cli.engine.kernels import native
jit.compile_cache_dir = lambda: Path(sys.argv[2])  # (each tier its own build: the cache keeps one library)
from dflash_cli.engine.kernels.quantized import Int4Linear, Int8Linear
torch.manual_seed(7)
x = torch.randn(9, 576).to(torch.bfloat16)
int4 = Int4Linear.from_weight(torch.randn(200, 576), torch.bfloat16)  # (a partial last block of 8 lanes)
int8 = Int8Linear.from_weight(torch.randn(192, 576), torch.bfloat16)
grouped = Int8Linear.from_groups(torch.randint(-127, 128, (48, 576)), torch.rand(48, 18) / 64, torch.bfloat16)
assert int4.native and int8.native and grouped.native
keys, values = (torch.randn(2, 3, 300, 64).to(torch.bfloat16) for _ in range(2))
rows, positions = torch.randn(2, 3, 12, 64).to(torch.bfloat16), torch.tensor([[5, 6, 7, 8], [290, 291, 292, 293]])
attention = torch.ops.dflash.attention(rows, keys, values, positions, 0.125)
logits = torch.randn(3, 49152).to(torch.bfloat16)
dense = torch.ops.dflash.bf16_linear(torch.randn(9, 600).to(torch.bfloat16), torch.randn(70, 600).to(torch.bfloat16))
products = [int4(x), int8(x), grouped(x), dense]
torch.save([native.loaded_tier(), *products, attention, torch.ops.dflash.argmax(logits)], sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.needs_no_kernels
def test_the_avx2_tier_gives_the_avx512_tiers_bits(tmp_path) -> None:
    """The AVX2 tier (`DFLASH_CPU_KERNELS=avx2`) runs every op with the same integer sums and float operations, 8
    lanes at a time: the same bits as the AVX-512 tier (the bf16 products' and attention's: short of denormals), so
    a stored step or a measurement means the same on either (where this CPU has AVX-512: else the tests above run
    the AVX2 tier here)."""
    if native.cpu_tier() != "avx512":
        pytest.skip(f"the AVX-512 tier does not run here ({native.unusable() or 'this CPU lacks AVX-512 BF16'})")
    results = {}
    for tier in ("avx512", "avx2"):
        env = {**os.environ, native.ENVIRONMENT: tier}
        subprocess.run(
            [sys.executable, "-c", _TIER_PRODUCTS, str(tmp_path / tier), str(tmp_path / f"{tier}-cache")],
            env=env,
            check=True,
        )
        results[tier] = torch.load(tmp_path / tier)
    assert [results[tier][0] for tier in ("avx512", "avx2")] == ["avx512", "avx2"]
    for wide, narrow in zip(results["avx512"][1:], results["avx2"][1:]):
        assert torch.equal(wide, narrow)


@pytest.mark.slow
@pytest.mark.needs_no_kernels
def test_the_environment_takes_the_avx2_tier_and_it_defines_every_op() -> None:
    """`DFLASH_CPU_KERNELS=avx2`: the AVX2 tier, every op of the AVX-512 tier defined (nothing left on torch's)."""
    if native.cpu_tier() is None:
        pytest.skip(native.unusable())
    code = (
        "import torch; from dflash_cli.engine.kernels import native\n"
        "print(native.available(), native.loaded_tier(), native.unavailable())\n"
        "print(*(hasattr(torch.ops.dflash, op) for op in ('bf16_linear', 'int4_linear', 'int8_linear', 'attention', 'argmax')))\n"
    )
    env = {**os.environ, native.ENVIRONMENT: "avx2"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    tier, ops = done.stdout.splitlines()
    assert tier.split() == ["True", "avx2", "None"] and ops.split() == ["True"] * 5
