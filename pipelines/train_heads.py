"""DVC stage 'train_heads' of the draft heads: python pipelines/train_heads.py [heads=NAME] (see posttrainllm/lab/heads.py)."""

import sys

from posttrainllm.lab.heads import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("train_heads", sys.argv[1:]))
