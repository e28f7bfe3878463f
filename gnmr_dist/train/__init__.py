"""The training programs, the top layer of gnmr-dist: they import every layer below and none
imports them.

* :mod:`gnmr_dist.train.ds_pretrain`: ``gnmr-ds-pretrain``, Llama on DeepSpeed (``make demo``).
* :mod:`gnmr_dist.train.megatron_lm`: ``gnmr-megatron-pretrain``, Megatron-LM's training loop.
* :mod:`gnmr_dist.train.launch`: ``gnmr-launch``, preflight of either program's config and the
  torchrun / deepspeed / Slurm command line.
* :mod:`gnmr_dist.train.common`: what the programs share (the ``"gnmr"`` block's preflight,
  logging set-up, the next-token loss, the run summary).
"""
