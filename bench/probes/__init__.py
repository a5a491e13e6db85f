"""Measurements outside the benchmark's run, each a script of its own (one line each):

- `lease_margin.py`: lease renewals per second a step's local lease deadline costs, per margin.
- `monitor_step.py`: every Redis command a step issues inside `agents worker` (MONITOR), per step.
- `profile_step.py`: where one step's time goes in one process (its pieces timed, pyinstrument).
- `profile_worker.py`: where `agents worker`'s steps processes spend their CPU (py-spy samples).
- `replicated.py`: steps/s and a primary's CPU per step alone and under Sentinel (with and without
  writes waiting for a replica), and memory per session (docs/deployment.md, "Sizing").
- `sandbox_modes.py`: what a runIsolated call can reach in each worker mode (docs/security.md).
- `scale.py`: Redis memory per paused session and the cost of reading many (100,000 by default).
- `slow_split.py`: the slow-model phase's CPU split by process (optionally profiled with py-spy).
- `stream_cost.py`: worker CPU and Redis commands per step with streaming on and off (demo, HTTP).
"""
