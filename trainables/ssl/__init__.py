"""The paper's algorithm as plain PyTorch functions: CowMask and box masks (``masks``), the consistency regularizers
and their registry (``regularizers``), the losses and confidence gating (``losses``) and the teacher's EMA (``ema``).

Imports nothing of cowtune but ``trainables.validation``; anything may import it.
"""
MAY_IMPORT = ("trainables.validation",)
