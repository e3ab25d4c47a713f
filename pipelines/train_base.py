"""DVC stage 'train_base' of the draft heads: python pipelines/train_base.py [heads=NAME] (see posttrainllm/lab/heads.py)."""

import sys

from posttrainllm.lab.heads import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("train_base", sys.argv[1:]))
