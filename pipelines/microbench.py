"""DVC stage 'microbench' of one sweep point: python pipelines/microbench.py POINT (posttrainllm/lab/stages/microbench.py)."""

import sys

from posttrainllm.lab.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("microbench", sys.argv[1:]))
