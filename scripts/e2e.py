"""The whole pipeline as one script: the same as `rlhf e2e` (SFT -> reward -> PPO).

    python scripts/e2e.py                         # built-in offline default (tiny model, `sort` task)
    python scripts/e2e.py --output runs/demo --ppo.kl-coef 0.1
    torchrun --nproc-per-node 2 scripts/e2e.py --output runs/demo2
"""

import sys

from rlhf.cli import main

if __name__ == "__main__":
    main(["e2e", *sys.argv[1:]])
