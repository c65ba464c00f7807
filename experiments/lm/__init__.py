"""A small character-level language-modelling testbed (Tiny Shakespeare) for infrequent-synchronization methods.

- :mod:`experiments.lm.data`: the text (checksummed), its 65-character
  vocabulary, the 90/10 train/validation split, the per-worker window sampler
  and the fixed validation windows.
- :mod:`experiments.lm.model`: :class:`~experiments.lm.model.CharTransformer`,
  a Flax NNX decoder-only transformer, and its ``"tiny"``/``"default"`` sizes.
- :mod:`experiments.lm.sharded`: :class:`~experiments.lm.sharded.TransformerLM`,
  a token LM whose parameters carry logical-axis annotations mapped to
  ``(data, fsdp, tensor)`` meshes by rules, and its own jitted train step.
- :mod:`experiments.lm.train`: :func:`~experiments.lm.train.train`, M workers
  data-parallel under ``jax.shard_map`` with any optax transform built by
  ``make_tx(axis_name)`` (a compressor chain, or DiLoCo-style local steps).
"""
