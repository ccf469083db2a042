"""The speed machinery: CUDA-graph step capture, the update in two parts, CUDA streams, the Triton convolutions and
the operator switch to them, the weight-gradient stream, conv+bias+ReLU, stored gradients, the paired batch norms'
backward kernels, the first-compile lock and compile-ahead, and GPU turns for packed trials.

None of it changes what a step computes: the plain path in ``trainables/step.py`` is the specification, and the
tests compare the two. The core still imports some of these modules directly; a narrow interface, one switch, is
the next step of issue 37.
"""
