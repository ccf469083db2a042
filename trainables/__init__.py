"""cowtune's package. Its top-level modules are the trainer core: the typed config and presets (``config``,
``presets``), the step as the paper writes it (``step``), ``trainer`` (``fit``: epochs, checkpoint, resume),
``optim``, ``metrics``, ``evaluate``, ``data_parallel`` and the ``cowtune`` command (``cli``), beside a few
helpers every layer may use (``validation``, ``file_locks``, ``child_process``).

The layers, each package's ``MAY_IMPORT`` saying what its modules may import when they run (besides their own
package; ``tests/test_boundaries.py`` keeps it so): ``ssl`` (the algorithm), ``data`` and ``models`` below; then
``fast`` (what only makes it faster); then this core, which reaches ``fast`` through ``trainables.fast.switch``
only; then ``search`` (Ray, Optuna, MLflow), which only ``cli`` reaches, inside its subcommands.
"""
MAY_IMPORT = ("trainables.ssl", "trainables.data", "trainables.models", "trainables.fast.switch",
              "trainables.search")
