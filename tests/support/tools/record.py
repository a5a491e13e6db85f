#!/usr/bin/env python3
"""A command tool for tests: appends one line per run to the log file named by argv[1]
(tool name, idempotency key, arguments) and answers with its arguments echoed as JSON. With
`"gate": PATH` among its arguments it finishes only once that file exists (a test opens the gate)."""

import json
import os
import sys
import time

log, name = sys.argv[1], sys.argv[2]
args = json.load(sys.stdin)
delay = float(args.get("sleep", 0))
with open(log, "a") as f:
    f.write(
        json.dumps(
            {
                "tool": name,
                "key": os.environ.get("AGENTS_IDEMPOTENCY_KEY"),
                "args": args,
                "phase": "start",
                "pid": os.getpid(),
            }
        )
        + "\n"
    )
if delay:
    time.sleep(delay)
gate = args.get("gate")
while gate and not os.path.exists(gate):
    time.sleep(0.05)
with open(log, "a") as f:
    f.write(json.dumps({"tool": name, "key": os.environ.get("AGENTS_IDEMPOTENCY_KEY"), "phase": "end"}) + "\n")
print(json.dumps({"tool": name, "echo": args}))
