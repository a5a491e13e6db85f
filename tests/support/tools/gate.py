#!/usr/bin/env python3
"""A command tool for tests that answers once a gate opens: it writes `<gate>.started`, then waits
(at most two minutes) until the file named by the `gate` argument exists, and answers "opened"."""

import json
import sys
import time
from pathlib import Path

args = json.load(sys.stdin)
gate = Path(args["gate"])
Path(f"{gate}.started").touch()
deadline = time.monotonic() + 120
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"gate": "opened" if gate.exists() else "timed out"}))
