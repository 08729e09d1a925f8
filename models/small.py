"""A small CNN: the default model of cswap-train (trains in seconds on a CPU).

conv-ReLU-maxpool twice and a two-layer classifier: four ReLU/pool
activations for cswap to offload, enough to show decisions change.
"""

from __future__ import annotations

from torch import nn

__all__ = ["SmallCNN", "small_cnn"]


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10, image_size: int = 32, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * side * side, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def small_cnn(dataset: str = "cifar10", num_classes: int | None = None) -> SmallCNN:
    if dataset == "imagenet":
        return SmallCNN(num_classes or 1000, 224)
    if dataset == "cifar10":
        return SmallCNN(num_classes or 10, 32)
    raise ValueError(f"cswap.models.small_cnn: dataset must be 'imagenet' or 'cifar10', got {dataset!r}")
