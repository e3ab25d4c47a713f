"""DVC stage 'reference' of one sweep point: python pipelines/reference.py POINT (posttrainllm/lab/stages/reference.py)."""

import sys

from posttrainllm.lab.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("reference", sys.argv[1:]))
