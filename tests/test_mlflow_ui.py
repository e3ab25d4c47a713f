"""The MLflow UI shows the runs table, not MLflow 3's GenAI overview: scripts/check-mlflow-ui.sh in a headless browser.

Skipped where chromium is absent (CI machines); `apt-get install -y chromium` to run it.
"""

import os
import shutil
import subprocess
import sys

import pytest

from posttrainllm.config import PROJECT_ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")), reason="no chromium here")
def test_ui_opens_the_experiment_on_its_runs():
    pytest.importorskip("mlflow")
    done = subprocess.run(["bash", str(PROJECT_ROOT / "scripts" / "check-mlflow-ui.sh")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "shows the runs table" in done.stdout
