"""The code tables of bitsandbytes' 4-bit and 8-bit quantizers, and lookup tables derived from them.

Two kinds of constants live here and they must not be confused:

* the *code tables* (``quant_map`` / ``nested_quant_map`` in a checkpoint) are built by bitsandbytes in
  Python (float64 literals rounded to float32, FP4 divided by 12 in float32);
* the *decision thresholds* of the CUDA kernel (``dQuantizeNF4`` / ``dQuantizeFP4``) are C++ ``float``
  literals, rounded by the compiler straight from decimal to float32. Several NF4 thresholds sit almost
  exactly on a float32 midpoint, where decimal -> float64 -> float32 rounds the other way, so they are
  written below as float32 bit patterns (the values the compiled kernel compares against).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

# bitsandbytes' NF4 table (normal-distribution quantiles, normalised to [-1, 1]).
_NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# bitsandbytes' FP4 table in code order (sign bit, 2 exponent bits, 1 mantissa bit), divided by 12 below.
# Code 0b1000 is +0.0, not -0.0: bitsandbytes writes it as the Python integer ``-0``, which is plain 0.
_FP4_VALUES = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)

# dQuantizeNF4's 15 split points, ascending (decimal literal in the CUDA source -> float32 bits):
_NF4_SPLIT_BITS = (
    0xBF591CD9,  # -0.8480964004993439
    0xBF1C5270,  # -0.6106329262256622
    0xBEEB8480,  # -0.4599952697753906
    0xBEADEA76,  # -0.33967943489551544
    0xBE703CEC,  # -0.23460740596055984
    0xBE0D38BC,  # -0.13791173323988914
    0xBD3A7871,  # -0.045525018125772476
    0x3D22FAFF,  # 0.03979014977812767
    0x3DF64863,  # 0.1202552504837513
    0x3E5067E0,  # 0.2035212516784668
    0x3E9582D4,  # 0.2920137718319893
    0x3EC753F9,  # 0.3893125355243683
    0x3F006D03,  # 0.5016634166240692
    0x3F248DAF,  # 0.6427869200706482
    0x3F5C89D9,  # 0.8614784181118011
)
# dQuantizeFP4's 7 magnitude split points, ascending, and the 3-bit code of each magnitude interval.
_FP4_SPLIT_BITS = (
    0x3B2AAAB9,  # 0.00260417
    0x3DB00000,  # 0.0859375
    0x3E555555,  # 0.20833333
    0x3E955555,  # 0.29166667
    0x3ED55556,  # 0.4166667
    0x3F155550,  # 0.583333
    0x3F555555,  # 0.8333333
)
_FP4_MAGNITUDE_CODES = (0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011)

_FLT_MIN_BITS = 0x00800000  # smallest normal float32, 2**-126
# FP4 rank of y in [-0.00260417, -FLT_MIN] (code 0b1000, "negative zero"); rank + 1 holds a flushed -0.0.
FP4_NEGATIVE_ZERO_RANK = 7

# bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(): 7 exponent bits), float32 little-endian.
_DYNAMIC_MAP_HEX = (
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf000053bf66664fbfcdcc4bbf333348bf"
    "9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbfcdcc27bf343324bf9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf"
    "00000bbf666607bfcccc03bf333300bf3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabe"
    "cccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327becdcc18be66660abe0000f8bd3433dbbd"
    "85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd"
    "1f855bbd000050bde17a44bdc3f538bda3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc"
    "643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb5c8f42bb2db21dbbfca9f1ba9defa7ba"
    "ff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b94b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000"
    "b7a31335941a5a36ff0502370642b23734803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a9defa73a"
    "fca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033ccdcc0c3c1804163c643b1f3c48e13a3c"
    "c3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d"
    "5d8f723d7b147e3dcdcc843d5d8f8a3deb51903d7b14963d0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d"
    "0000f83d66660a3ecdcc183e3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e6666943e9a999b3ecccca23e0000aa3e"
    "3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33eccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f"
    "3433123fcdcc153f6666193f00001d3f9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f9a99443f3333483f"
    "cdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f0000773f9a997a3f33337e3f0000803f"
)


def _f32(bits: tuple[int, ...] | list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@functools.cache
def code_table(quant_type: str) -> torch.Tensor:
    """The 16-entry float32 table bitsandbytes stores as ``quant_map`` for ``quant_type``."""
    if quant_type == "nf4":
        return torch.tensor(_NF4_VALUES, dtype=torch.float32)
    if quant_type == "fp4":
        return torch.tensor(_FP4_VALUES, dtype=torch.float32) / 12.0
    raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")


@functools.cache
def dynamic_map() -> torch.Tensor:
    """The 256-entry float32 table bitsandbytes uses (and stores) for 8-bit double quantization."""
    return torch.frombuffer(bytearray.fromhex("".join(_DYNAMIC_MAP_HEX)), dtype=torch.float32)


def _rank_splits(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """15 ascending float32 splits s_k and the 16 codes, such that the kernel's code for a scaled value y
    is ``codes[#{k : y > s_k}]`` -- the CUDA decision tree rewritten as a sorted search.

    NF4's tree already compares y against ascending splits with ``>``, so the codes are 0..15. FP4 compares
    |y| with ``>`` and takes the sign from ``y < 0`` after the kernel's flush-to-zero; on the negative side
    ``|y| > m`` is ``y < -m``, i.e. ``not (y > nextafter(-m, -inf))``, and a flushed denormal is a positive
    zero, so the sign split is ``y > -FLT_MIN``.
    """
    if quant_type == "nf4":
        return _f32(_NF4_SPLIT_BITS), torch.arange(16, dtype=torch.uint8)
    # Negative float32 bit patterns grow with magnitude: +1 is one step towards -inf.
    negative = [0x80000000 | b + 1 for b in reversed(_FP4_SPLIT_BITS)]
    splits = negative + [0x80000000 | _FLT_MIN_BITS] + list(_FP4_SPLIT_BITS)
    codes = [0b1000 | c for c in reversed(_FP4_MAGNITUDE_CODES)] + list(_FP4_MAGNITUDE_CODES)
    return _f32(splits), torch.tensor(codes, dtype=torch.uint8)


def _bucket_ranks(splits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(base uint8 [65536], split float32 [65536], holds bool [65536]) such that #{k : y > splits[k]} is
    ``base[K] + (y > split[K])`` for every y whose top 16 bits are K (splits ascending, at most 255), and
    ``y > split[K]`` can only hold where ``holds[K]``: the bucket has a split inside it.

    A bucket K is the set of float32 values sharing their top 16 bits: an interval of y. The tables are
    exact as long as no bucket holds two splits, which is checked here (a bucket is < 0.8% wide).
    """
    top = torch.arange(65536, dtype=torch.int64) << 16
    first = top.to(torch.int32).view(torch.float32)  # smallest |y| of the bucket
    last = (top | 0xFFFF).to(torch.int32).view(torch.float32)  # largest |y| of the bucket
    negative = torch.arange(65536) >= 0x8000
    low = torch.where(negative, last, first)
    high = torch.where(negative, first, last)
    rank_low = torch.searchsorted(splits, low)  # number of splits < low
    rank_high = torch.searchsorted(splits, high)
    finite = torch.isfinite(low) & torch.isfinite(high)
    assert bool(((rank_high - rank_low)[finite] <= 1).all()), "a bucket holds two splits"
    padded = torch.cat([splits, torch.tensor([float("inf")])])
    return rank_low.to(torch.uint8), padded[rank_low], (rank_high != rank_low) & finite


# Set in a `bucket_tables` rank where the bucket holds a split: the only buckets whose compare can change the rank.
SPLIT_FLAG = 0x80


@functools.cache
def bucket_tables(quant_type: str) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
    """Lookup tables that turn a scaled value y into its 4-bit code with one gather, and a compare only for the
    few values that fall in a bucket holding one of the kernel's splits.

    Returns (ranks, split, byte_map) for K the top 16 bits of y (see `_bucket_ranks`): ranks uint8 [65536] is
    the rank of every y of bucket K among the splits, ``| SPLIT_FLAG`` where the bucket holds a split; there the
    rank is ``(ranks[K] & ~SPLIT_FLAG) + (y > split[K])`` (float32 [65536]). byte_map is None when ranks are the
    codes (NF4), else a uint8 [256] table mapping two packed ranks to two packed codes. Why one gather: the
    lookups were the kernel's largest cost, and only 1.1-1.3% of Gaussian weights (FP4, NF4; block 64) land in a
    bucket with a split.
    """
    splits, codes = _rank_splits(quant_type)
    base, split, holds = _bucket_ranks(splits)
    assert len(splits) < SPLIT_FLAG, "ranks must leave the flag bit free"
    ranks = torch.where(holds, base | SPLIT_FLAG, base)
    byte_map = None
    if not torch.equal(codes, torch.arange(16, dtype=torch.uint8)):
        pairs = torch.arange(256)
        byte_map = (codes[pairs >> 4].to(torch.int32) << 4 | codes[pairs & 15]).to(torch.uint8).numpy()
    return ranks, split.numpy(), byte_map


@functools.cache
def dynamic_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(base, split, midpoint) for the 8-bit search: s = #{i < 255 : code[i] < y} is
    ``base[K] + (y > split[K])``, and midpoint[s] = (code[s-1] + code[s]) * 0.5 in float32, the value
    the kernel compares y with (midpoint[0] = -inf: below code[0] there is nothing to choose)."""
    code = dynamic_map()
    base, split, _ = _bucket_ranks(code[:255])
    midpoint = torch.cat([torch.tensor([float("-inf")]), (code[:-1] + code[1:]) * 0.5])
    return base, split, midpoint
