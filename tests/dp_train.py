"""``moerl`` on four fixed easy training problems (so a rise in reward is learning, not luck), for a launch by an
outer ``torchrun``: ``torchrun --nproc-per-node 2 dp_train.py train ...``."""

import sys

from run_helpers import fix_four_problems

from moerl.cli import main

fix_four_problems()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
