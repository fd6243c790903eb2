"""semspec's CPU runtime: the numeric formats and the kernels that run them.

``formats`` picks a model's format for the CPU at hand and quantizes its linear layers; ``int8_kernel``
and ``int4_kernel`` are the weight-only matrix products, ``attention`` the decode attention and
``decode_layer`` a whole decoder layer's decoding call; their C++ sources are in ``csrc/``. Only the LM
adapter's loading (``models/lm``) imports this package; the algorithm (``models/spec``) never
does.
"""
