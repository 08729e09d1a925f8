"""The codecs as torch custom ops: eager, opcheck, and inside torch.compile."""

import pytest
import torch

import cswap
from bitdata import assert_bit_equal, random_bits


@pytest.mark.parametrize("name", cswap.codecs.names())
def test_ops_round_trip_every_codec(name):
    x = random_bits((5, 70), torch.bfloat16, 0.6)
    data = torch.ops.cswap.compress(x, name)
    assert torch.equal(data, cswap.codecs.get(name).compress(x).data)
    assert_bit_equal(torch.ops.cswap.decompress(data, list(x.shape), x.dtype), x)


def test_opcheck():
    x = torch.relu(torch.randn(4, 300))  # opcheck compares outputs with ==: no NaN payloads here
    data = torch.ops.cswap.compress(x, "zvc")
    torch.library.opcheck(torch.ops.cswap.decompress.default, (data, [4, 300], torch.float32))
    torch.library.opcheck(torch.ops.cswap.compress.default, (x, "rle"),
                          test_utils=("test_schema", "test_faketensor"))


def test_ops_inside_torch_compile():
    torch._dynamo.reset()

    def round_trip(x):
        data = torch.ops.cswap.compress(x, "zvc")
        return torch.ops.cswap.decompress(data, list(x.shape), x.dtype) * 1

    x = torch.relu(torch.randn(8, 64))
    assert_bit_equal(torch.compile(round_trip, backend="aot_eager", fullgraph=True)(x), x)
    torch._dynamo.reset()


def test_decompress_checks_shape_and_dtype():
    x = random_bits((3, 4), torch.float32, 0.5)
    data = torch.ops.cswap.compress(x, "csr")
    with pytest.raises(ValueError, match="not torch.float16"):
        torch.ops.cswap.decompress(data, [3, 4], torch.float16)
    with pytest.raises(ValueError, match=r"shape \(3, 4\)"):
        torch.ops.cswap.decompress(data, [4, 3], torch.float32)
