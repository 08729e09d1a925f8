"""AlexNet (Krizhevsky, Sutskever and Hinton, 2012), the single-GPU variant
("One weird trick", Krizhevsky 2014) that torchvision ships.

ImageNet shape: 3x224x224 input, five convolutions (64, 192, 384, 256, 256
channels; 11x11/4 stem), three 3x3/2 max-pools, a 6x6 adaptive average pool
and a 4096-wide classifier: 61,100,840 parameters (torchvision's figure).

CIFAR shape (our adaptation for 3x32x32): the same five convolutions and
channel counts, but a 5x5/1 stem instead of 11x11/4 (which would leave 7x7
after the first layer) and 2x2/2 max-pools, so the features end at 256x4x4;
no adaptive pool, and a 1024-wide classifier (the 4096-wide one would hold
most of the parameters for a 10-way problem): 7,706,442 parameters.
"""

from __future__ import annotations

from torch import nn

__all__ = ["AlexNet", "alexnet"]


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000, small_input: bool = False):
        super().__init__()
        if small_input:
            stem = nn.Conv2d(3, 64, 5, padding=2)
            pool, side, width = (lambda: nn.MaxPool2d(2)), 4, 1024
        else:
            stem = nn.Conv2d(3, 64, 11, stride=4, padding=2)
            pool, side, width = (lambda: nn.MaxPool2d(3, stride=2)), 6, 4096
        self.features = nn.Sequential(
            stem, nn.ReLU(inplace=True), pool(),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), pool(),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), pool(),
        )
        # 224 input leaves 6x6 already; the adaptive pool (torchvision's) only
        # matters for other input sizes. 32 input leaves 4x4 exactly.
        self.avgpool = nn.Identity() if small_input else nn.AdaptiveAvgPool2d((side, side))
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(), nn.Linear(256 * side * side, width), nn.ReLU(inplace=True),
            nn.Dropout(), nn.Linear(width, width), nn.ReLU(inplace=True),
            nn.Linear(width, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


def alexnet(dataset: str = "imagenet", num_classes: int | None = None) -> AlexNet:
    if dataset == "imagenet":
        return AlexNet(num_classes or 1000, small_input=False)
    if dataset == "cifar10":
        return AlexNet(num_classes or 10, small_input=True)
    raise ValueError(f"cswap.models.alexnet: dataset must be 'imagenet' or 'cifar10', got {dataset!r}")
