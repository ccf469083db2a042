"""Learning curves of a run as a PNG (matplotlib, headless), for MLflow artifacts."""
from __future__ import annotations

from pathlib import Path

CURVE_FILE = "learning_curve.png"


def learning_curve_png(history: list[dict[str, float]], path: Path, title: str) -> Path:
    """Every val/* and train/loss_* metric against the epoch, as a PNG (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_err, ax_loss) = plt.subplots(1, 2, figsize=(9, 3.5))
    epochs = [h["epoch"] for h in history]
    for key in sorted(history[-1]):
        ax = ax_err if key.startswith(("val/error", "test/error")) else ax_loss if "loss" in key else None
        if ax is not None:
            ax.plot(epochs, [h.get(key, float("nan")) for h in history], marker=".", label=key)
    for ax, label in ((ax_err, "error"), (ax_loss, "loss")):
        ax.set_xlabel("epoch"), ax.set_ylabel(label), ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
