"""DVC stage 'decode' of the draft heads: python pipelines/decode.py [heads=NAME] (see posttrainllm/lab/heads.py)."""

import sys

from posttrainllm.lab.heads import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("decode", sys.argv[1:]))
