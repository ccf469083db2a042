"""The speed machinery: compile options (``compile_options``) and the first-compile lock (``compile_lock``), the whole
step as one CUDA graph (``step_graph``) with the update in two parts (``split_update``), the step's numbers as
device tensors (``device_numbers``), CUDA streams (``cuda_streams``), our Triton convolutions and the operator switch
to them (``fast_conv``, ``conv_rows``), the weight-gradient stream (``wgrad_stream``), conv+bias+ReLU, stored
gradients, the paired batch norms' backward kernels, the models' fast blocks that call them (``model_swaps``), and GPU
turns for packed trials.

None of it changes what a step computes: the plain step in ``trainables/step.py`` and the plain models in
``trainables/models/`` are the specification, and the tests compare the two. The core enters through one door,
``trainables.fast.switch``, and only when ``train.fast`` is on; a built model's blocks are switched to their fast
variants there (``model_swaps.speed_up_model``). It imports the algorithm, data and models it speeds up, never the
core, and the models import nothing of it.
"""
MAY_IMPORT = ("trainables.ssl", "trainables.data", "trainables.models", "trainables.file_locks")
