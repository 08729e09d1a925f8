"""What smaller LZ4 chunks cost in ratio on real activations.

A chunk is one LZ4 block and one warp's work when decoding: smaller chunks give
a tensor more independent blocks to decode at once (a 64 KiB chunk gives an
8 MB tensor 128 warps, fewer than one per SM-slot on an H100), but every block
starts with nothing to match against. This measures that cost on the ReLU and
pooling outputs cswap offloads: small_cnn, VGG16 and ResNet-18 at CIFAR shapes
on scikit-learn's digits (no download), one forward pass at initialisation, fp32.

    python benchmarks/lz4_chunks.py [--batch 32] [--chunks 65536 32768 16384 8192]

Prints, per chunk size, the byte-weighted ratio (original / compressed, cswap's
LZ4 encoder, its PyTorch backend: the same bytes as the GPU kernel) and the
size relative to 64 KiB chunks. Measured on CPU; the ratio does not depend on
the device.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from cswap.kernels import lz4
from cswap.models import build
from cswap.models.data import load_data


def activations(name: str, images: torch.Tensor) -> list[torch.Tensor]:
    """ReLU and pooling outputs of one forward pass of model `name`."""
    torch.manual_seed(0)
    model = build(name, dataset="cifar10").eval()
    saved = []
    hook = lambda module, args, out: saved.append(out.detach().clone())  # noqa: E731
    for module in model.modules():
        if isinstance(module, (nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
            module.register_forward_hook(hook)
    with torch.no_grad():
        model(images)
    return saved


def compressed_bytes(t: torch.Tensor, chunk: int) -> int:
    data = t.contiguous().view(-1).view(torch.uint8)
    out = []
    lz4.lz4_compress_ref(data, lambda n: out.append(torch.empty(n, dtype=torch.uint8)) or out[0], chunk=chunk)
    return out[0].numel()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--models", nargs="+", default=["small_cnn", "vgg16", "resnet18"])
    p.add_argument("--chunks", type=int, nargs="+", default=[65536, 32768, 16384, 8192])
    args = p.parse_args(argv)
    x = load_data("digits", 32, seed=0)[0]
    tensors = [t for name in args.models for t in activations(name, x[: args.batch])]
    original = sum(t.numel() * t.element_size() for t in tensors)
    sparsity = sum(int((t == 0).sum()) for t in tensors) / sum(t.numel() for t in tensors)
    print(f"# {len(tensors)} activations of {', '.join(args.models)} (batch {args.batch}, digits, fp32): "
          f"{original / 2**20:.1f} MiB, {sparsity:.0%} zeros; cswap's LZ4 encoder")
    print(f"{'chunk':>8} {'ratio':>7} {'size vs 64 KiB':>15}")
    sizes = {chunk: sum(compressed_bytes(t, chunk) for t in tensors) for chunk in args.chunks}
    base = sizes.get(65536) or sizes[max(sizes)]
    for chunk, size in sizes.items():
        print(f"{chunk:>8} {original / size:>7.3f} {size / base - 1:>+14.2%}")
    return sizes


if __name__ == "__main__":
    main()
