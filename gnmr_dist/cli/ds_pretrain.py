"""``gnmr-ds-pretrain``: the DeepSpeed training program, :mod:`gnmr_dist.train.ds_pretrain`."""

from gnmr_dist.train.ds_pretrain import main

if __name__ == "__main__":
    raise SystemExit(main())
