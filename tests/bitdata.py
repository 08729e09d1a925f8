"""Test tensors with every kind of bit pattern, and bit-exact comparison."""

from __future__ import annotations

import torch

WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of `t` (what lossless is judged on)."""
    return t.contiguous().view(WORD[t.element_size()])


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.device == expected.device, (actual.device, expected.device)
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()[:5].tolist()
        raise AssertionError(f"bits differ at {bad} (of {a.numel()})")


def random_bits(shape, dtype, sparsity=0.5, device="cpu", generator=None) -> torch.Tensor:
    """Uniformly random bit patterns (NaN payloads, denormals, -0.0 included), with
    a random `sparsity` fraction of elements set to all-zero bits."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=generator)
    words = raw.view(WORD[itemsize]).clone()
    if dtype == torch.bool:  # only 0/1 are valid bools
        words = words & 1
    keep = torch.rand(n, generator=generator) >= sparsity
    words = torch.where(keep, words, torch.zeros((), dtype=words.dtype))
    return words.view(dtype).reshape(shape).to(device)


def blocky(shape, dtype, sparsity=0.5, run=64, device="cpu", generator=None) -> torch.Tensor:
    """Non-zero values with zeros in runs of about `run` elements, as ReLU of a
    smooth feature map gives."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    n = 1
    for d in shape:
        n *= d
    nblocks = max(1, -(-n // run))
    zero_block = torch.rand(nblocks, generator=generator) < sparsity
    mask = zero_block.repeat_interleave(run)[:n]
    x = random_bits((n,), dtype, 0.0, generator=generator)
    w = bits(x).clone()
    w[w == 0] = 1  # no stray zeros outside the runs
    w[mask] = 0
    return w.view(dtype).reshape(shape).to(device)


def special_values(dtype, device="cpu") -> torch.Tensor:
    """-0.0, NaNs with payloads, infinities, denormals, extremes, and zeros."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    w = WORD[itemsize]
    if dtype in FLOAT_DTYPES:
        f = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0],
                         dtype=dtype)
        fi = torch.finfo(dtype)
        extra = torch.tensor([fi.tiny, fi.tiny / 4, -fi.tiny / 8, fi.max, fi.min, fi.eps], dtype=dtype)
        f = torch.cat([f, extra])
        nan_payloads = {2: [0x7C01, 0xFE01, 0x7FFF, 0xFFC1], 4: [0x7F800001, 0xFFC00123, 0x7FFFFFFF],
                        8: [0x7FF0000000000001, -0x0007FFFFFFFFFFFF]}[itemsize]
        if dtype == torch.bfloat16:
            nan_payloads = [0x7F81, 0x7FFF, -0x007F]
        nans = torch.tensor([p if p < 2 ** (8 * itemsize - 1) else p - 2 ** (8 * itemsize)
                             for p in nan_payloads], dtype=w).view(dtype)
        x = torch.cat([f, nans, f.new_zeros(5)])
    elif dtype == torch.bool:
        x = torch.tensor([True, False, False, True])
    elif itemsize == 1:  # int8, uint8, float8: every bit pattern (-0.0, NaN, denormals), then zeros
        x = torch.cat([torch.arange(256, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)]).view(dtype)
    else:
        info = torch.iinfo(dtype)
        x = torch.tensor([0, 1, -1 if info.min < 0 else 2, info.max, info.min, 0, 0], dtype=dtype)
    return x.to(device)


def rewrap(blob, meta=None, payload=None) -> torch.Tensor:
    """The bytes of `blob` with a valid header (its CRC passes) but other meta or payload."""
    from cswap.codecs.container import pack_header

    payload = blob.payload.clone() if payload is None else payload
    meta = blob.meta if meta is None else meta
    raw = pack_header(blob.codec, blob.dtype, tuple(blob.shape), meta, payload.numel())
    return torch.cat([torch.frombuffer(bytearray(raw), dtype=torch.uint8), payload])
