"""prequant's CPU 4-bit kernel: byte-identical to bitsandbytes' CUDA kernel, and correct on new inputs.

Three kinds of evidence:
* golden bytes made by bitsandbytes' CUDA kernel on an H200 (tests/data/golden.safetensors) and a few
  values measured on the same GPU (torch's CUDA mean, MUFU.RCP), embedded below;
* independent scalar references written from the CUDA source (the decision trees, the 8-bit binary
  search, the reduction schedule thread by thread), compared on random and adversarial inputs;
* properties that hold whatever the bytes (round-trip error bound, rank of the reciprocal, chunking and
  memory layout not changing the result).
"""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import DATA
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prequant.bnb.kernels import _cuda_mean, _dynamic8, _fastmath, cpu

GOLDEN = DATA / "golden.safetensors"
FLT_MIN = 2.0**-126
f32 = np.float32


# ----------------------------------------------------------------------------- golden bytes (H200 CUDA)


def _golden_cases() -> list[str]:
    from safetensors import safe_open

    with safe_open(GOLDEN, "pt") as f:
        return sorted(json.loads(f.metadata()["cases"]))


@pytest.fixture(scope="module")
def golden():
    from safetensors import safe_open

    with safe_open(GOLDEN, "pt") as f:
        cases = json.loads(f.metadata()["cases"])
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith("/dequant")}  # noqa: SIM118
    return cases, tensors


@pytest.fixture(params=["torch-threads", "one-torch-thread"])
def torch_threads(request):
    """torch's own thread count as it is, and 1 (a worker process's): where torch has one thread, the kernel
    runs some passes as torch operations, elsewhere as numpy ones (`_quantize4`)."""
    before = torch.get_num_threads()
    if request.param == "one-torch-thread":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", _golden_cases())
def test_golden_bytes_equal_cuda(golden, case, torch_threads):
    """Packed codes, absmax (or nested codes, nested absmax and nested_offset) equal the CUDA output."""
    cases, t = golden
    meta = cases[case]
    x = t[case.split("/")[0] + "/input"]
    packed, absmax = cpu.quantize_4bit(x, quant_type=meta["quant_type"], blocksize=meta["blocksize"])
    assert torch.equal(packed, t[case + "/weight"].view(-1))
    if "nested_offset" not in meta:
        assert torch.equal(absmax, t[case + "/absmax"])
        return
    codes, nested_absmax, offset = cpu.quantize_nested(absmax, blocksize=meta["nested_blocksize"])
    assert torch.equal(codes, t[case + "/absmax"])
    assert torch.equal(nested_absmax, t[case + "/nested_absmax"])
    assert offset == meta["nested_offset"]  # the exact float32 of torch's CUDA mean, not just close


def test_code_tables_equal_golden_bytes(golden):
    """quant_map and nested_quant_map are byte-identical to what bitsandbytes stores."""
    cases, t = golden
    for case, meta in cases.items():
        assert cpu.code_table(meta["quant_type"]).numpy().tobytes() == t[case + "/quant_map"].numpy().tobytes()
        if "nested_offset" in meta:
            assert cpu.dynamic_map().numpy().tobytes() == t[case + "/nested_quant_map"].numpy().tobytes()


def test_code_tables_are_fresh_copies():
    """Mutating a returned table does not change the next one."""
    cpu.code_table("nf4").zero_()
    cpu.dynamic_map().zero_()
    assert cpu.code_table("nf4")[0] == -1.0 and cpu.dynamic_map()[255] == 1.0


# ----------------------------------------------------------------------------- the GPU's reciprocal

# (input bits, MUFU.RCP output bits) read on an H200; half of them are not the correctly rounded result.
MUFU_RCP_SAMPLES = [
    (0x3F80E832, 0x3F7E32E1), (0x3F80E856, 0x3F7E329A), (0x3F8005A9, 0x3F7FF4AE), (0x3F8005AA, 0x3F7FF4AC),
    (0x3FD6216A, 0x3F190736), (0x3FE4F257, 0x3F0F2004), (0x3F8276EF, 0x3F7B29F9), (0x3FDE8AE0, 0x3F133E69),
    (0x3FA297D9, 0x3F4988A0), (0x3FA8856B, 0x3F4271C5), (0x3FD15FB2, 0x3F1C8139), (0x3FA5A2FB, 0x3F45D4A4),
]  # fmt: skip


def _bits(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.view(torch.int32).tolist()]


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_rcp_matches_gpu_samples_at_every_exponent():
    """rcp_approx_ftz reproduces measured MUFU.RCP results, scaled exactly by powers of two."""
    for shift in (-100, -3, 0, 5, 90):
        a = _from_bits([b + (shift << 23) for b, _ in MUFU_RCP_SAMPLES])
        want = [r - (shift << 23) for _, r in MUFU_RCP_SAMPLES]
        assert _bits(_fastmath.rcp_approx_ftz(a)) == want


def test_rcp_is_a_neighbour_of_the_exact_reciprocal():
    """Every result brackets 1/a with the other float32 neighbour: error below one ulp, never more."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0x00800000, 0x7E800000, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    a = bits.view(torch.float32)
    r = _fastmath.rcp_approx_ftz(a)
    exact = 1.0 / a.double()
    lo = torch.minimum(r, (r.view(torch.int32) - 1).view(torch.float32)).double()
    hi = torch.maximum(r, (r.view(torch.int32) + 1).view(torch.float32)).double()
    assert bool(((lo < exact) & (exact < hi)).all())
    nearest = (1.0 / a.double()).float()
    flipped = (r != nearest).double().mean().item()
    assert 0.10 < flipped < 0.16  # about 13% of mantissas take the farther neighbour


def test_rcp_special_inputs():
    """0 and denormals give +inf (flush-to-zero), 2**126 gives 2**-126, anything larger flushes to 0."""
    a = torch.tensor([0.0, 1e-40, FLT_MIN, 2.0**126, 2.0**126 * (1 + 2**-23), 3e38], dtype=torch.float32)
    r = _fastmath.rcp_approx_ftz(a)
    assert r[0] == math.inf and r[1] == math.inf
    assert r[2] == 2.0**126 and r[3] == 2.0**-126
    assert r[4] == 0.0 and r[5] == 0.0


# ----------------------------------------------------------------------------- torch's CUDA mean


def _hash_floats(n: int, seed: int) -> np.ndarray:
    """Deterministic float32 values in [0.01, 3.01), the inputs the GPU means below were measured on."""
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = i * np.uint64(6364136223846793005) + np.uint64(seed) * np.uint64(1442695040888963407) + np.uint64(12345)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    return ((h >> np.uint64(40)).astype(np.float32) * f32(3.0 / 2**24) + f32(0.01)).astype(np.float32)


# (n, seed, bits of torch.mean on an H200): small, vectorized with tails, several blocks, grid-capped.
CUDA_MEANS = [
    (1, 0, 1056270560), (2, 1, 1077151452), (3, 2, 1073776856), (5, 4, 1067216306), (64, 63, 1069920567),
    (127, 126, 1070647939), (128, 127, 1069698838), (129, 128, 1068445419), (131, 130, 1070117501),
    (1000, 751, 1069777804), (4097, 709, 1069813133), (131073, 729, 1069633213), (262145, 733, 1069629501),
    (917504, 760, 1069615277), (4194311, 763, 1069635517), (5000000, 764, 1069635532),
]  # fmt: skip


@pytest.mark.parametrize(("n", "seed", "bits"), CUDA_MEANS)
def test_cuda_mean_equals_gpu_measurement(n, seed, bits):
    """The replayed reduction gives the exact float32 the GPU gave."""
    got = _cuda_mean.cuda_mean(torch.from_numpy(_hash_floats(n, seed)))
    assert _bits(got.view(1)) == [bits]


def _reference_cuda_mean(v: np.ndarray, multiprocessors: int = 132) -> np.float32:
    """Thread-by-thread transcription of torch's CUDA reduction schedule (Reduce.cuh), float32 scalars."""
    n = len(v)

    def tree(vals: list) -> np.float32:
        width = len(vals)
        while width > 1:
            width //= 2
            vals = [vals[t] + vals[t + width] for t in range(width)]
        return vals[0]

    if n < 128:
        width = 1 << (n.bit_length() - 1)
        total = tree([(f32(0) + v[t]) + (v[t + width] if t + width < n else f32(0)) for t in range(width)])
    else:
        width = min(1 << ((n // 4).bit_length() - 1), 512)
        per_thread = -(-n // width)
        blocks = 1
        if per_thread >= 256:
            blocks = max(min(multiprocessors * (2048 // width), -(-per_thread // 16)), -(-per_thread // 256))
        stride = width * blocks
        results = []
        for b in range(blocks):
            lanes = []
            for lane in range(width):
                acc = [f32(0)] * 4
                idx = b * width + lane
                while idx * 4 + 3 < n:
                    acc = [acc[i] + v[4 * idx + i] for i in range(4)]
                    idx += stride
                if b == 0 and lane < n % 4:
                    acc[0] = acc[0] + v[n - n % 4 + lane]
                lanes.append(((acc[0] + acc[1]) + acc[2]) + acc[3])
            results.append(tree(lanes))
        if blocks == 1:
            total = results[0]
        else:
            staged = []
            for t in range(width):
                s = f32(0)
                for i in range(t, blocks, width):
                    s = s + results[i]
                staged.append(s)
            total = tree(staged)
    return f32(total * (f32(1) / f32(n)))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16))
def test_cuda_mean_equals_thread_level_reference(n, seed):
    """Vectorized replay == thread-by-thread transcription, small and vectorized sizes."""
    v = np.random.default_rng(seed).random(n, dtype=np.float32) * f32(4)
    assert float(_cuda_mean.cuda_mean(torch.from_numpy(v))) == float(_reference_cuda_mean(v))


@pytest.mark.parametrize("n", [131072 + 5, 150001])
def test_cuda_mean_several_blocks_equals_thread_level_reference(n):
    """The multi-block (global memory) stage is replayed in the same order."""
    v = np.random.default_rng(n).random(n, dtype=np.float32)
    assert float(_cuda_mean.cuda_mean(torch.from_numpy(v))) == float(_reference_cuda_mean(v))


# ----------------------------------------------------------------------------- independent 4-bit reference


def _f32_from_decimal(text: str) -> float:
    """Round a decimal literal straight to float32 (as a C++ compiler does), not through float64."""
    exact = Fraction(text)
    guess = f32(float(exact))
    candidates = [np.nextafter(guess, f32(-np.inf)), guess, np.nextafter(guess, f32(np.inf))]
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array(c).view(np.int32)) & 1)))


D = _f32_from_decimal  # the CUDA source's float literals


def _nf4_tree(x: float) -> int:
    """dQuantizeNF4 from bitsandbytes' csrc/kernels.cu, branch for branch."""
    if x > D("0.03979014977812767"):
        if x > D("0.3893125355243683"):
            if x > D("0.6427869200706482"):
                return 0b1111 if x > D("0.8614784181118011") else 0b1110
            return 0b1101 if x > D("0.5016634166240692") else 0b1100
        if x > D("0.2035212516784668"):
            return 0b1011 if x > D("0.2920137718319893") else 0b1010
        return 0b1001 if x > D("0.1202552504837513") else 0b1000
    if x > D("-0.33967943489551544"):
        if x > D("-0.13791173323988914"):
            return 0b0111 if x > D("-0.045525018125772476") else 0b0110
        return 0b0101 if x > D("-0.23460740596055984") else 0b0100
    if x > D("-0.6106329262256622"):
        return 0b0011 if x > D("-0.4599952697753906") else 0b0010
    return 0b0001 if x > D("-0.8480964004993439") else 0b0000


def _fp4_tree(x: float) -> int:
    """dQuantizeFP4 from bitsandbytes' csrc/kernels.cu, branch for branch."""
    sign = 0b1000 if x < 0 else 0
    x = abs(x)
    if x > D("0.29166667"):
        if x > D("0.583333"):
            return (0b0011 if x > D("0.8333333") else 0b0010) + sign
        return (0b101 if x > D("0.4166667") else 0b100) + sign
    if x > D("0.0859375"):
        return (0b0111 if x > D("0.20833333") else 0b0110) + sign
    return (0b0001 if x > D("0.00260417") else 0b0000) + sign


def _ftz_mul(x: float, r: float) -> float:
    """FMUL.FTZ: IEEE product of two float32, flushed when below FLT_MIN after 24-bit rounding."""
    exact = x * r  # exact in float64 (24 x 24 bits), or NaN/inf
    if math.isfinite(exact) and abs(exact) < FLT_MIN * (1 - 2**-25):
        return 0.0
    return float(f32(exact))


def _reference_4bit(x: torch.Tensor, quant_type: str, blocksize: int) -> tuple[bytes, list[float]]:
    """kQuantizeBlockwise, scalar: flush denormal inputs, absmax, MUFU reciprocal, tree, pack."""
    vals = [0.0 if abs(v) < FLT_MIN else v for v in x.reshape(-1).float().tolist()]
    tree = _nf4_tree if quant_type == "nf4" else _fp4_tree
    blocks = [vals[i : i + blocksize] for i in range(0, len(vals), blocksize)]
    absmaxes = [max(abs(v) for v in block) for block in blocks]
    scales = _fastmath.rcp_approx_ftz(torch.tensor(absmaxes, dtype=torch.float32)).tolist()
    codes = []
    for block, r in zip(blocks, scales):
        codes += [tree(_ftz_mul(v, r)) for v in block + ([0.0] if len(block) % 2 else [])]
    return bytes(codes[i] << 4 | codes[i + 1] for i in range(0, len(codes), 2)), absmaxes


def _adversarial(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return (torch.randn(n, generator=g) * 0.02).to(dtype)
    if kind == "bits":  # any finite bit pattern: denormals, tiny and huge values
        if dtype == torch.float32:
            x = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(dtype)
        else:
            x = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int64).to(torch.int16).view(dtype)
        return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=dtype))
    if kind == "ties":  # values exactly on the kernel's split points (times a power-of-two absmax)
        splits = [D(s) for s in ("0.03979014977812767", "-0.045525018125772476", "0.8614784181118011", "0.29166667",
                                 "-0.00260417", "-0.8333333", "0.5016634166240692", "-0.4166667")]  # fmt: skip
        idx = torch.randint(0, len(splits), (n,), generator=g)
        x = torch.tensor(splits)[idx] * 4.0
        x[::17] = 4.0
        return x.to(dtype)
    if kind == "zeros":  # whole zero blocks next to normal ones
        x = torch.randn(n, generator=g)
        x[: n // 2] = 0.0
        return x.to(dtype)
    raise AssertionError(kind)


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 2500),
    blocksize=st.sampled_from(cpu.BLOCKSIZES),
    quant_type=st.sampled_from(cpu.QUANT_TYPES),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    kind=st.sampled_from(["normal", "bits", "ties", "zeros"]),
    seed=st.integers(0, 2**16),
)
def test_4bit_equals_scalar_reference(n, blocksize, quant_type, dtype, kind, seed):
    """The vectorized kernel == the decision trees applied element by element, on odd counts, partial
    blocks, every blocksize and dtype, denormal/huge values, exact ties and zero blocks."""
    x = _adversarial(kind, n, dtype, seed)
    packed, absmax = cpu.quantize_4bit(x, quant_type=quant_type, blocksize=blocksize)
    want_packed, want_absmax = _reference_4bit(x, quant_type, blocksize)
    assert packed.numpy().tobytes() == want_packed
    assert absmax.tolist() == want_absmax


def test_fp4_sign_of_products_rounding_to_flt_min():
    """FP4's sign bit where the CPU's product is exactly -FLT_MIN follows the GPU's flush rule (24-bit
    rounding, not the denormal grid): the products here straddle that boundary, some on each side."""
    g = torch.Generator().manual_seed(11)
    absmax = (torch.rand(100, generator=g) * 900 + 100).to(torch.float32)
    r = _fastmath.rcp_approx_ftz(absmax)
    base = (-FLT_MIN / r.double()).float()
    offsets = torch.arange(-4, 5, dtype=torch.int32)
    near = (base.view(torch.int32)[:, None] + offsets).view(torch.float32)
    x = torch.cat([absmax[:, None], near, torch.zeros(100, 64 - 1 - offsets.numel())], 1).reshape(-1)
    exact = near.double() * r.double()[:, None]
    on_limit = (near * r[:, None]) == -FLT_MIN
    flushed = exact.abs() < FLT_MIN * (1 - 2**-25)
    assert bool((on_limit & flushed).any()) and bool((on_limit & ~flushed).any())  # both cases occur
    packed, _ = cpu.quantize_4bit(x, quant_type="fp4", blocksize=64)
    want, _ = _reference_4bit(x, "fp4", 64)
    assert packed.numpy().tobytes() == want


# ----------------------------------------------------------------------------- independent 8-bit reference


def _dquantize_reference(code: list[float], x: float) -> int:
    """dQuantize<0> from csrc/kernels.cu: 7-step binary search from pivot 127, then the midpoint test."""
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = f32(-1.0), f32(1.0)
    x = f32(x)
    val = f32(code[pivot])
    for i in (64, 32, 16, 8, 4, 2, 1):
        if x > val:
            lower_pivot, lower, pivot = pivot, val, pivot + i
        else:
            upper_pivot, upper, pivot = pivot, val, pivot - i
        val = f32(code[pivot])
    if upper_pivot == 255:
        upper = f32(code[upper_pivot])
    if lower_pivot == 0:
        lower = f32(code[lower_pivot])
    if x > val:
        return upper_pivot if x > (upper + val) * f32(0.5) else pivot
    return lower_pivot if x < (lower + val) * f32(0.5) else pivot


def _reference_8bit(values: list[float], blocksize: int) -> tuple[list[int], list[float]]:
    code = cpu.dynamic_map().tolist()
    vals = [0.0 if abs(v) < FLT_MIN else v for v in values]
    blocks = [vals[i : i + blocksize] for i in range(0, len(vals), blocksize)]
    absmaxes = [max(abs(v) for v in block) for block in blocks]
    scales = _fastmath.rcp_approx_ftz(torch.tensor(absmaxes, dtype=torch.float32)).tolist()
    codes = []
    for block, r in zip(blocks, scales):
        codes += [_dquantize_reference(code, _ftz_mul(v, r)) for v in block]
    return codes, absmaxes


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(1, 1500), seed=st.integers(0, 2**16))
def test_8bit_equals_binary_search_reference(n, seed):
    """Double quantization's 8-bit codes == the kernel's binary search, on values at codes and midpoints."""
    g = np.random.default_rng(seed)
    code = cpu.dynamic_map().numpy()
    pool = np.concatenate([code, (code[:-1] + code[1:]) * f32(0.5)])
    scale = f32(2.0 ** g.integers(-8, 8))
    values = (g.choice(pool, n) * scale).astype(np.float32)
    values = (values.view(np.int32) + g.integers(-1, 2, n).astype(np.int32)).view(np.float32)
    values = np.where(np.isfinite(values), values, f32(0)).astype(np.float32)
    values[g.random(n) < 0.05] = scale  # some blocks reach their absmax exactly
    codes, absmax = _dynamic8.quantize_8bit(torch.from_numpy(values), 256)
    want_codes, want_absmax = _reference_8bit(values.tolist(), 256)
    assert codes.tolist() == want_codes
    assert absmax.tolist() == want_absmax


def test_nested_offset_is_the_cuda_mean_and_codes_follow_it():
    """quantize_nested subtracts the replayed CUDA mean before the 8-bit step."""
    absmax = torch.from_numpy(_hash_floats(5000, 3))
    codes, nested_absmax, offset = cpu.quantize_nested(absmax)
    assert offset == float(_reference_cuda_mean(absmax.numpy()))
    want_codes, want_absmax = _reference_8bit((absmax - torch.tensor(offset, dtype=torch.float32)).tolist(), 256)
    assert codes.tolist() == want_codes and nested_absmax.tolist() == want_absmax


def test_nested_with_overflowing_mean_follows_the_gpu():
    """A sum past float32's range makes the mean inf; the GPU then codes every absmax as 0 (NaN path)."""
    codes, nested_absmax, offset = cpu.quantize_nested(torch.full((300,), 3e38))
    assert offset == math.inf
    assert bool((codes == 0).all()) and bool(torch.isinf(nested_absmax).all())


# ----------------------------------------------------------------------------- properties


def _dequantize(packed, absmax, quant_type, n):
    codes = torch.stack([packed >> 4, packed & 15], 1).view(-1)[:n].long()
    values = cpu.code_table(quant_type)[codes]
    return values.view(-1) * absmax.repeat_interleave(64)[:n]


@pytest.mark.parametrize("quant_type", cpu.QUANT_TYPES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantize_roundtrip_error_is_bounded(quant_type, double_quant):
    """|x - dequant(quant(x))| is within half the widest code gap times absmax (plus the absmax's own
    8-bit error with double quantization)."""
    x = (torch.randn(333, 257, generator=torch.Generator().manual_seed(7)) * 0.05).to(torch.bfloat16)
    n = x.numel()
    packed, absmax = cpu.quantize_4bit(x, quant_type=quant_type, blocksize=64)
    if double_quant:
        codes, nested_absmax, offset = cpu.quantize_nested(absmax)
        scales = cpu.dynamic_map()[codes.long()] * nested_absmax.repeat_interleave(256)[: codes.numel()]
        approx_absmax = scales + offset
        assert bool(((approx_absmax - absmax).abs() <= 0.01 * absmax.max()).all())
        absmax_used, slack = approx_absmax, (approx_absmax - absmax).abs().repeat_interleave(64)[:n]
    else:
        absmax_used, slack = absmax, torch.zeros(n)
    table = cpu.code_table(quant_type).sort().values
    half_gap = float((table[1:] - table[:-1]).max()) / 2
    err = (x.float().view(-1) - _dequantize(packed, absmax_used, quant_type, n)).abs()
    bound = half_gap * absmax.repeat_interleave(64)[:n] + slack + 1e-6
    assert bool((err <= bound).all())


def test_non_contiguous_input_equals_its_contiguous_copy(monkeypatch):
    """Transposed, permuted and strided views quantize as their row-major copies, across chunk edges."""
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(cpu, "TASK_ELEMENTS", 4 * 4096)
    g = torch.Generator().manual_seed(3)
    views = [
        torch.randn(37, 129, 5, generator=g).permute(2, 0, 1),
        torch.randn(301, 77, generator=g).t(),
        torch.randn(9, 9000, generator=g)[:, ::3],
        torch.randn(5000, generator=g)[1::2],
        torch.randn(3, 1, generator=g).expand(3, 7001),
    ]
    for x in views:
        for quant_type in cpu.QUANT_TYPES:
            got = cpu.quantize_4bit(x.to(torch.bfloat16), quant_type=quant_type, blocksize=64)
            want = cpu.quantize_4bit(x.contiguous().to(torch.bfloat16), quant_type=quant_type, blocksize=64)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_chunk_size_does_not_change_the_bytes(monkeypatch):
    """Chunks are whole blocks: a small chunk gives the same bytes as the default one."""
    x = (torch.randn(1_000_003, generator=torch.Generator().manual_seed(4)) * 0.1).to(torch.float16)
    want = cpu.quantize_4bit(x, quant_type="nf4", blocksize=128)
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 8192)
    got = cpu.quantize_4bit(x, quant_type="nf4", blocksize=128)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_output_shapes_and_dtypes():
    """packed: uint8 [ceil(n/2)], absmax: float32 [ceil(n/blocksize)]."""
    packed, absmax = cpu.quantize_4bit(torch.randn(3, 7, 11), quant_type="nf4", blocksize=64)
    assert packed.dtype == torch.uint8 and packed.shape == (116,)
    assert absmax.dtype == torch.float32 and absmax.shape == (4,)
    codes, nested_absmax, offset = cpu.quantize_nested(torch.rand(1000))
    assert codes.dtype == torch.uint8 and codes.shape == (1000,)
    assert nested_absmax.dtype == torch.float32 and nested_absmax.shape == (4,) and isinstance(offset, float)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_input_raises(bad, dtype):
    """NaN or Inf anywhere (here in the last, partial block) raises NonFiniteError, a ValueError."""
    x = torch.randn(1000).to(dtype)
    x[-3] = bad
    with pytest.raises(cpu.NonFiniteError):
        cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
    assert issubclass(cpu.NonFiniteError, ValueError)


@pytest.mark.parametrize(
    ("x", "kwargs"),
    [
        (torch.randn(8), {"quant_type": "int4", "blocksize": 64}),
        (torch.randn(8), {"quant_type": "nf4", "blocksize": 32}),
        (torch.arange(8), {"quant_type": "nf4", "blocksize": 64}),
        (torch.randn(8, device="meta"), {"quant_type": "nf4", "blocksize": 64}),
    ],
)
def test_bad_arguments_raise_value_error(x, kwargs):
    """Unsupported quant type, blocksize, dtype or device is refused up front."""
    with pytest.raises(ValueError):
        cpu.quantize_4bit(x, **kwargs)


def test_mostly_agrees_with_bitsandbytes_cpu_path():
    """Loose cross-check against bitsandbytes' own CPU path, which is not bit-exact with CUDA: > 99% of
    the codes agree (for FP4 once +0 and -0, codes 0b0000 and 0b1000, count as one: bitsandbytes' CPU
    path gives tiny negative values the other zero code), and absmax is identical."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    x = (torch.randn(256, 512, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    for quant_type in cpu.QUANT_TYPES:
        ref, state = bnb.quantize_4bit(x, blocksize=64, quant_type=quant_type, quant_storage=torch.uint8)
        packed, absmax = cpu.quantize_4bit(x, quant_type=quant_type, blocksize=64)
        ours, theirs = (torch.stack([p >> 4, p & 15], 1).view(-1) for p in (packed, ref.view(-1)))
        if quant_type == "fp4":
            ours, theirs = (torch.where(c == 0b1000, 0, c) for c in (ours, theirs))
        assert (ours == theirs).double().mean() > 0.99
        assert torch.equal(absmax, state.absmax)


@pytest.mark.skipif(not os.environ.get("PREQUANT_BIG_TESTS"), reason="set PREQUANT_BIG_TESTS=1 (needs ~2 GB, ~1 min)")
def test_more_than_2_pow_31_elements():
    """No int32 limit: a 2**31 + 3 element tensor (a stride-0 view, so no 4 GB input) quantizes fully."""
    n = 2**31 + 3
    big = torch.tensor([-1.0], dtype=torch.bfloat16).expand(n)
    packed, absmax = cpu.quantize_4bit(big, quant_type="nf4", blocksize=64)
    assert packed.numel() == (n + 1) // 2 and absmax.numel() == -(-n // 64)
    assert bool((packed[:-1] == 0x00).all()) and int(packed[-1]) == 0x07  # -1 -> code 0; odd pad 0 -> 7
    assert bool((absmax == 1.0).all())
