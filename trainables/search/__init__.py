"""The search platform: the Ray Tune trainable, the search driver and its settings, MLflow tracking,
``cowtune promote``, ``cowtune final`` and its data-parallel runs (Ray Train).

The only subpackage that imports ray, optuna or mlflow. The core (``trainables.cli``) reaches it only lazily,
inside the subcommands; nothing outside it imports it at module level except search_spaces/ and the tests. It
may import any of cowtune.
"""
MAY_IMPORT = ("trainables",)
