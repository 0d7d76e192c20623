"""Training built on the front doors.

``train`` (``data_parallel_step`` and its helpers), ``data_axes`` and
``step_checks`` (the mesh axes and the step's checks), ``nnx`` (Flax NNX's
``DataParallel``; needs flax), ``lossy`` (packet loss across steps),
``dropcompute`` and ``thresholds`` (DropCompute), and ``multiprocess`` (one
process per worker). ``dq.nnx``, ``dq.dropcompute`` and ``dq.multiprocess``
reach these modules from the package's top.
"""
