"""The paper's networks (AlexNet, VGG16, ResNet, MobileNet, SqueezeNet, Plain20).

Placeholder package: the models arrive with the end-to-end benchmark issue.
"""

__all__: list[str] = []
