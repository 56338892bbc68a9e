"""
train.py with faults injected (tests/faults.py), in a process of its own, for tests that kill it:

    python tests/faulty_train.py FAULT=VALUE ... -- --key=value ...   (train.py's own arguments after --)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import faults  # noqa: E402
from machinery.errors import run_main  # noqa: E402
import train  # noqa: E402

if __name__ == "__main__":
    split = sys.argv.index("--")
    faults.inject(dict(arg.split("=", 1) for arg in sys.argv[1:split]))
    run_main(lambda: train.main(sys.argv[split + 1:]))
