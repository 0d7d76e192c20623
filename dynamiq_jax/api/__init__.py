"""The front doors: the calls a user makes.

``transform`` (the optax transforms ``compressed_psum`` and
``compressed_psum_scatter``), ``allreduce``, ``scatter`` (``reduce_scatter``),
``tp`` (``tp_psum``) and ``simulate``. Each builds one
:class:`dynamiq_jax.engine.options.ReduceOptions` and hands it to the engine.
``import dynamiq_jax as dq`` re-exports their public names.
"""
