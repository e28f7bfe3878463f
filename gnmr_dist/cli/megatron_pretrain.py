"""``gnmr-megatron-pretrain``: Megatron-LM's ``pretrain_gpt.py`` with GNMR
(:mod:`gnmr_dist.train.megatron_lm`)."""

from gnmr_dist.train.megatron_lm import main

if __name__ == "__main__":
    raise SystemExit(main())
