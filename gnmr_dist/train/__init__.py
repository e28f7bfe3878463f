"""The training programs, the top layer of the library: they import every layer below; only
the thin entry points of :mod:`gnmr_dist.cli` (and ``benchmarks``) import them.

* :mod:`gnmr_dist.train.ds_pretrain`: ``gnmr-ds-pretrain``, Llama on DeepSpeed (``make demo``).
* :mod:`gnmr_dist.train.megatron_lm`: ``gnmr-megatron-pretrain``, Megatron-LM's training loop.
* :mod:`gnmr_dist.train.launch`: ``gnmr-launch``, preflight of either program's config and the
  torchrun / deepspeed / Slurm command line.
* :mod:`gnmr_dist.train.common`: what the programs share (logging set-up, the next-token loss;
  the ``"gnmr"`` block is read by :func:`gnmr_dist.integrations.config.read_block`).
"""
