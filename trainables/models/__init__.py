"""Models: a registry (``create_model``, ``check_model``, ``list_models``) and one module per family.

All models take NCHW float images (any size >= 32; ``cnn_tiny`` >= 8) and return logits (N, classes). Batch-norm
layers become ``SegmentedBatchNorm2d`` in ``create_model``. Importing this package registers every family; import
a family's classes from its module (``trainables.models.shakeshake``, ...). Anything may import this package; it
imports only ``trainables.validation``. These are the plain modules: ``trainables.fast.model_swaps`` switches a built
model's blocks to their fast variants, when ``train.fast`` is on.
"""
# Each family registers its models when imported; in this order, the registry's order
from trainables.models import wrn  # noqa: F401, I001
from trainables.models import shakeshake  # noqa: F401, I001
from trainables.models import torchvision_resnets  # noqa: F401, I001
from trainables.models import cnn  # noqa: F401, I001
from trainables.models.registry import MODELS, check_model, count_parameters, create_model, list_models, register_model

MAY_IMPORT = ("trainables.validation",)

__all__ = ["MODELS", "check_model", "count_parameters", "create_model", "list_models", "register_model"]
