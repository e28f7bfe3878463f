"""``gnmr-launch``: preflight and launch of a shipped config, :mod:`gnmr_dist.train.launch`."""

from gnmr_dist.train.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
