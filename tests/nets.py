"""Tiny test models for the runtime tests (CPU friendly: a few KiB per activation).

Every factory seeds torch itself, so two calls give bit-identical weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VGGLike(nn.Module):
    """conv/ReLU/maxpool stacks and a linear classifier after flatten."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),                  # 0, 1
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=inplace),   # 2, 3
            nn.MaxPool2d(2),                                           # 4
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),                 # 5, 6
            nn.MaxPool2d(2),                                           # 7
        )
        self.classifier = nn.Sequential(nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetLike(nn.Module):
    """BatchNorm, in-place ReLU and shortcut additions (one identity, one projection)."""

    def __init__(self, linear_head: bool = True):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10) if linear_head else nn.Conv2d(16, 10, 1)
        self.linear_head = linear_head

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        x = self.pool(x)
        if self.linear_head:
            return self.fc(torch.flatten(x, 1))
        return self.fc(x).flatten(1)


class FunctionalNet(nn.Module):
    """Activations and pooling called as functions inside forward (no activation modules)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv4 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2)
        x = F.leaky_relu(self.conv2(x), 0.1)
        x = F.avg_pool2d(x, 2)
        x = F.relu6(self.conv3(x) * 4)
        x = F.max_pool2d(F.relu(self.conv4(x)), 2)
        return self.fc(torch.flatten(x, 1))


class TransformerNet(nn.Module):
    """torch.nn.TransformerEncoder with ReLU feed-forward (deterministic: dropout 0)."""

    def __init__(self, d_model: int = 16):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0,
                                           activation="relu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class Tiny(nn.Module):
    """Hand-counted saves (see test_dedup_counts_exactly)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 10))

    def forward(self, x):
        return self.body(x)


def _seeded(cls, *args, **kwargs):
    def make():
        torch.manual_seed(0)
        return cls(*args, **kwargs)
    return make


vgg_like = _seeded(VGGLike)
vgg_like_inplace = _seeded(VGGLike, inplace=True)
resnet_like = _seeded(ResNetLike)
resnet_like_conv_head = _seeded(ResNetLike, linear_head=False)
functional_net = _seeded(FunctionalNet)
transformer_net = _seeded(TransformerNet)
tiny = _seeded(Tiny)

IMAGE = (2, 3, 16, 16)
SEQUENCE = (2, 5, 16)

# name -> (factory, input shape)
MODELS = {
    "vgg": (vgg_like, IMAGE),
    "vgg_inplace": (vgg_like_inplace, IMAGE),
    "resnet": (resnet_like, IMAGE),
    "functional": (functional_net, IMAGE),
    "transformer": (transformer_net, SEQUENCE),
}


def batches(shape, steps: int, seed: int = 1, classes: int = 10, channels_last: bool = False):
    """`steps` (input, target) pairs, the same for every call with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(*shape, generator=gen)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append((x, torch.randint(0, classes, (shape[0],), generator=gen)))
    return out
