"""The imperative shell around the scheduler: one step, one dispatched call, journaling, leases.

Shared by the Celery tasks and the CLI's inline mode; holds no Celery code itself.
"""

from celery_agents.runtime.calls import CallRun, run_call
from celery_agents.runtime.ports import FencedLlm, JournaledTools, SecureIds, SystemClock
from celery_agents.runtime.step import StepResult, commit_transition, run_step

__all__ = [
    "CallRun",
    "FencedLlm",
    "JournaledTools",
    "SecureIds",
    "StepResult",
    "SystemClock",
    "commit_transition",
    "run_call",
    "run_step",
]
