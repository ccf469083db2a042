"""torchvision's ResNets, freshly initialised (never downloaded): ``resnet18``, ``resnet50``, ``resnet152``."""
from __future__ import annotations

from torch import nn

from trainables.models.registry import register_model


# torchvision definitions, random init; zero-init of the last BN matches reference §6.4.
def _torchvision_resnet(name: str, num_classes: int) -> nn.Module:
    import torchvision.models   # here, not at the top: torchvision imports torch._dynamo (2 s), which
    # a search driver or a `cowtune` command that builds no model never needs

    return getattr(torchvision.models, name)(weights=None, num_classes=num_classes, zero_init_residual=True)


@register_model("resnet18")
def resnet18(num_classes: int) -> nn.Module:
    return _torchvision_resnet("resnet18", num_classes)


@register_model("resnet50")
def resnet50(num_classes: int) -> nn.Module:
    return _torchvision_resnet("resnet50", num_classes)


@register_model("resnet152")
def resnet152(num_classes: int) -> nn.Module:
    return _torchvision_resnet("resnet152", num_classes)
