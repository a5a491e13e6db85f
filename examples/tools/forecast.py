#!/usr/bin/env python3
"""A command tool: reads its arguments as JSON on stdin, prints its result as JSON on stdout."""

import json
import sys

from celery_agents.tools.demo import get_forecast

args = json.load(sys.stdin)
if not isinstance(args.get("city"), str) or not args["city"].strip():
    print("city is required: give a city name", file=sys.stderr)
    sys.exit(2)
print(json.dumps(get_forecast(args["city"], int(args.get("days", 3)))))
